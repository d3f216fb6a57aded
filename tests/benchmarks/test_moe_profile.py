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
    report = json.loads((ROOT / "benchmarks/moe-profile-h100.json").read_text())
    reference, fused = report["variants"]
    others = [row for name in ("moe-profile-autotune-h100.json", "moe-profile-h200.json", "moe-profile-modes-h200.json",
                                 "moe-profile-fp8-h200.json")
              for row in json.loads((ROOT / "benchmarks" / name).read_text())["variants"]]
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
