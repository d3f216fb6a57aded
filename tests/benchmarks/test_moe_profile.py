"""benchmarks/moe_profile.py: each kernel of the measured H100 profile falls in its part of the
step (the A/B's table and JSON are built from these parts); the measurement itself needs a GPU."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moe_profile  # noqa: E402


@pytest.mark.parametrize("kernel,part", [
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShape", "grouped GEMMs"),
    ("triton_tem_fused__grouped_mm_transpose_0", "grouped GEMMs"),  # Inductor's template under max-autotune
    ("triton_poi_fused_index_put_new_zeros_4", "MoE permutation"),
    ("_combine_bwd_kernel", "MoE permutation"),
    ("_swiglu_bwd_kernel", "SwiGLU"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "routing (top-k, sort)"),
    ("triton_red_fused__scaled_grouped_mm__to_copy_abs_amax_clamp_clamp_min_clone_exp2_floor", "FP8 casts"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "other"),
])
def test_kernels_fall_in_their_part(kernel, part):
    assert moe_profile.part_of(kernel) == part


def test_the_recorded_profiles_parts_are_its_kernels_by_part_of():
    """The recorded JSON's parts are what part_of makes of its kernels (a change to PARTS that the
    recorded parts do not follow fails here)."""
    report = json.loads((ROOT / "benchmarks/results/moe-profile-2b-permute-kernels-h100.json").read_text())
    reference, fused = report["variants"]
    others = [row for name in ("moe-profile-2b-compile-autotune-h100.json", "moe-profile-2b-permute-kernels-h200.json",
                               "moe-profile-2b-compile-modes-h200.json", "moe-profile-2b-fp8-experts-h200.json")
              for row in json.loads((ROOT / "benchmarks/results" / name).read_text())["variants"]]
    for row in (reference, fused, *others):
        by_part = {}
        for name, kernel in row["kernels"].items():
            by_part[moe_profile.part_of(name)] = by_part.get(moe_profile.part_of(name), 0.0) + kernel["ms"]
        assert by_part == pytest.approx(row["parts_ms"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_without_a_gpu_the_command_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["moe_profile.py", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        moe_profile.main()


def test_kernel_totals_counts_kernels_with_lambdas_and_leaves_annotations_out():
    """mfu_profile.kernel_totals, shared by mfu.py's profile and moe_profile: events built as the
    CUDA profiler gives them (no GPU here to profile)."""
    from types import SimpleNamespace

    from mfu_profile import kernel_totals

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, us, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    lam = "void at::native::reduce_kernel<{lambda(float, float)#1}>"
    prof = SimpleNamespace(events=lambda: [
        event(lam, 1000), event(lam, 500), event("_gather_rows_kernel", 2000),
        event("## Call CompiledFxGraph f0 ##", 9000), event("moe.router", 7000, annotation=True),
        event("ProfilerStep#1", 8000), event(lam, 4000, device=cpu)])
    totals, counts = kernel_totals(prof)
    assert totals == {lam: 1.5, "_gather_rows_kernel": 2.0} and counts == {lam: 2, "_gather_rows_kernel": 1}


def test_busy_time_is_the_union_of_the_kernels_intervals():
    """mfu_profile.busy_ms: kernels on two streams overlap (counted once), a gap between kernels is
    idle, and an annotation's range (which spans its kernels) is not a kernel."""
    from types import SimpleNamespace

    from mfu_profile import busy_ms

    cuda = torch.autograd.DeviceType.CUDA

    def event(name, start_us, end_us, annotation=False):
        return SimpleNamespace(name=name, device_type=cuda, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start_us, end=end_us))

    prof = SimpleNamespace(events=lambda: [
        event("gemm", 0, 1000), event("nccl_allreduce", 500, 1500),  # overlapping streams: 0-1500
        event("small", 1200, 1300),  # inside the span above
        event("after_a_gap", 3000, 3500),  # 1500-3000 idle
        event("moe.router", 0, 3500, annotation=True), event("## Call CompiledFxGraph f0 ##", 0, 3500)])
    assert busy_ms(prof) == pytest.approx(2.0)


def test_kernels_go_to_the_phase_open_at_their_launch_matched_by_the_runtime_calls_id():
    """mfu_profile.kernels_by_phase / phase_summary: each kernel lands in the ``megatrain.<phase>``
    range open when its cu* launch ran (correlation id), a CPU op sharing that id is not a launch,
    an annotation is not a kernel, and milliseconds add up per kernel name."""
    from types import SimpleNamespace

    from mfu_profile import kernels_by_phase, phase_summary, phased_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, corr=0, start=0, end=0, ns=0, annotation=False):
        return SimpleNamespace(name=lambda: name, device_type=lambda: device, correlation_id=lambda: corr,
                               start_ns=lambda: start, end_ns=lambda: end, duration_ns=lambda: ns,
                               is_user_annotation=lambda: annotation)

    bwd = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9x" + "x" * 200  # > 140 chars
    events = [
        event("megatrain.forward", cpu, start=0, end=100, annotation=True),
        event("megatrain.backward", cpu, start=200, end=400, annotation=True),
        event("cudaLaunchKernel", cpu, corr=1, start=10),
        event("gemm_fwd", cuda, corr=1, ns=2_000_000),
        # the autograd engine's thread launches while the main thread waits in the backward range
        event("cuLaunchKernel", cpu, corr=2, start=250),
        # a CPU op numbered by its own counter: listed after the launch it would overwrite, in forward
        event("aten::mm", cpu, corr=2, start=50),
        event(bwd, cuda, corr=2, ns=3_000_000),
        event("cudaLaunchKernel", cpu, corr=3, start=300),
        event(bwd, cuda, corr=3, ns=1_000_000),
        event("aten::mm", cpu, corr=4, start=50),  # its id's kernel has no launch: not forward's
        event("orphan_kernel", cuda, corr=4, ns=500_000),
        event("cudaLaunchKernel", cpu, corr=5, start=150),  # between the two ranges
        event("between_kernel", cuda, corr=5, ns=250_000),
        event("megatrain.forward", cuda, corr=1, ns=9_000_000, annotation=True),  # the range on the GPU's row
    ]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    phases = {phase: dict(names) for phase, names in kernels_by_phase(phased_kernels(prof)).items()}
    assert phases == {"forward": {"gemm_fwd": 2.0}, "backward": {bwd: 4.0},
                      "other": {"orphan_kernel": 0.5, "between_kernel": 0.25}}
    # per=2: two profiled steps give one step's milliseconds; top keeps full names, largest first
    assert phase_summary(phased_kernels(prof), per=2) == {
        "forward": {"kernel_ms": 1.0, "top": [{"name": "gemm_fwd", "ms": 1.0}]},
        "backward": {"kernel_ms": 2.0, "top": [{"name": bwd, "ms": 2.0}]},
        "other": {"kernel_ms": 0.375, "top": [{"name": "orphan_kernel", "ms": 0.25},
                                               {"name": "between_kernel", "ms": 0.125}]}}


def test_idle_gaps_go_to_the_phase_whose_kernel_ends_them():
    """mfu_profile.idle_by_phase: a gap between busy intervals (kernels of two streams overlap)
    is charged to the phase of the kernel that starts after it; no gap, no idle."""
    from types import SimpleNamespace

    from mfu_profile import idle_by_phase, phased_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, corr=0, start=0, end=0, ns=0, annotation=False):
        return SimpleNamespace(name=lambda: name, device_type=lambda: device, correlation_id=lambda: corr,
                               start_ns=lambda: start, end_ns=lambda: end, duration_ns=lambda: ns,
                               is_user_annotation=lambda: annotation)

    ms = 1_000_000
    events = [
        event("megatrain.forward", cpu, start=0, end=100, annotation=True),
        event("megatrain.backward", cpu, start=200, end=400, annotation=True),
        event("cudaLaunchKernel", cpu, corr=1, start=10), event("f1", cuda, corr=1, start=0, ns=2 * ms),
        event("cudaLaunchKernel", cpu, corr=2, start=20), event("f2", cuda, corr=2, start=ms, ns=3 * ms),  # overlaps f1
        event("cudaLaunchKernel", cpu, corr=3, start=250), event("b1", cuda, corr=3, start=5 * ms, ns=ms),  # 1 ms gap
        event("cudaLaunchKernel", cpu, corr=4, start=260), event("b2", cuda, corr=4, start=6 * ms, ns=ms),  # none
        event("cudaLaunchKernel", cpu, corr=5, start=150), event("o1", cuda, corr=5, start=9 * ms, ns=ms),  # 2 ms
    ]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert idle_by_phase(phased_kernels(prof)) == {"other": 2.0, "backward": 1.0}


def test_text_tokens_takes_windows_across_shards_in_name_order_and_refuses_too_few_or_the_wrong_width(tmp_path):
    """moe_profile.text_tokens on shards written by shard_format.write_shard: the first ``mb``
    windows of the shards under the folder (in subfolders too) in name order, as int64, and a
    SystemExit naming the folder for too few windows or another seq_len."""
    import re

    import numpy as np

    from megatrain.data.shard_format import write_shard

    seq_len = 4
    folder = tmp_path / "train"
    folder.mkdir()
    first = (np.arange(3 * (seq_len + 1)).reshape(3, seq_len + 1) + 1000).astype(np.uint16)
    second = (np.arange(3 * (seq_len + 1)).reshape(3, seq_len + 1) + 70000).astype(np.uint32)  # > uint16
    # the later name written first: the order is the names', not the writes'
    write_shard(str(folder / "shard-000001.tar"), second, 3)
    write_shard(str(folder / "shard-000000.tar"), first, 0)

    tokens = moe_profile.text_tokens(str(tmp_path), 5, seq_len)
    assert tokens.dtype == torch.int64 and tokens.shape == (5, seq_len + 1)
    assert torch.equal(tokens, torch.from_numpy(np.concatenate([first, second[:2]]).astype(np.int64)))

    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path}: needs 7 windows of {seq_len + 1} tokens")):
        moe_profile.text_tokens(str(tmp_path), 7, seq_len)  # 6 windows in all
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path}: needs 2 windows of 9 tokens")):
        moe_profile.text_tokens(str(tmp_path), 2, 8)
