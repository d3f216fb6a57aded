"""benchmarks/mfu_moe.py (issue 32): the MoE rows of benchmarks/mfu.py. The transformers baseline is
the class megatrain exports the recipe to, of the same shape; the profile split attributes the
backward's time to the MoE part whose forward recorded it; and the whole benchmark runs end to
end on a CPU at a tiny shape of configs/moe-gpu-2b.yaml (both rows finite, JSON written)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("transformers")

import mfu_moe  # noqa: E402
from megatrain.config import load_config  # noqa: E402
from megatrain.model import GPT, active_parameter_count, count_parameters  # noqa: E402
from megatrain.model.moe import MoE  # noqa: E402

# configs/moe-gpu-2b.yaml shrunk: what is MoE about it (softmax router, no renormalisation, no
# shared expert, aux + z loss) stays as the recipe has it
TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.vocab_size=512",
        "model.seq_len=64", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_d_ff=32"]


def tiny_cfg():
    return load_config(str(ROOT / "configs/moe-gpu-2b.yaml"), TINY)


def test_hf_baseline_is_the_exported_class_of_the_same_shape():
    cfg = tiny_cfg()
    torch.manual_seed(0)
    hf = mfu_moe.HFMoE(cfg.model, cfg.seq_len)
    ours = GPT(cfg.model)
    assert hf.architecture == "Qwen2MoeForCausalLM"
    m = cfg.model
    # the same parameters, plus Qwen2-MoE's gate [1, d] per layer in front of its zero-wide shared expert
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours) + m.n_layer * m.d_model
    assert mfu_moe.flops_params(m) == active_parameter_count(m) < count_parameters(ours)
    assert hf.aux_coef == pytest.approx(m.moe.aux_loss_coef / m.moe.top_k)
    idx = torch.randint(0, m.vocab_size, (2, cfg.seq_len))
    loss = hf(idx, idx)
    assert math.isfinite(loss.item()) and loss.requires_grad


def test_profile_split_puts_backward_time_on_the_forward_range():
    from torch.profiler import ProfilerActivity, profile

    cfg = tiny_cfg()
    torch.manual_seed(0)
    layer = MoE(cfg.model, layer=0)
    layer.experts.reset_parameters(0.02, 0.02)
    x = torch.randn(2, 32, cfg.model.d_model, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).square().sum().backward()
    split = mfu_moe.split_by_ranges(prof, on_device=False)
    for name in ("moe.router", "moe.dispatch", "moe.experts", "moe.combine"):
        part = split["by_range"][name]
        assert part["forward_ms"] > 0 and part["backward_ms"] > 0, (name, part)
    assert split["by_part_ms"]["all_to_all"] == 0  # no expert parallelism, no exchange
    parts = sum(v for k, v in split["by_part_ms"].items() if k != "rest_of_step")
    assert 0 < parts <= split["total_ms"] and split["by_part_ms"]["rest_of_step"] >= 0


def test_load_balance_reads_the_trainers_expert_health():
    health = lambda a, b: {"layers": {"0": {"max_over_mean": a, "entropy": 1.0}, "1": {"max_over_mean": b, "entropy": 1.2}},
                           "aux_loss": 1.0, "z_loss": 0.1}
    got = mfu_moe.load_balance([None, health(1.5, 1.1), health(1.2, 1.3)])
    assert got["steps"] == 2
    assert got["worst_layer_max_over_mean"] == 1.3 and got["mean_layer_max_over_mean"] == pytest.approx(1.25)
    assert got["worst_over_steps"] == 1.5 and got["mean_over_steps"] == pytest.approx(1.275)
    assert mfu_moe.load_balance([None]) is None


@pytest.mark.slow
def test_moe_benchmark_runs_both_rows_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    cmd = [sys.executable, "benchmarks/mfu.py", "--quick", "--device", "cpu", "--config", "configs/moe-gpu-2b.yaml",
           "--out", str(out), "--baseline-eager", "--default-mbs", "2", "--large-batch", "4", "--steps", "1", "--source-bytes", "100000",
           "--override", "model.compile=false", "--override", "train.micro_batch_size=2", *[a for o in TINY for a in ("--override", o)]]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["kind"]: r for r in report["results"]}
    assert set(rows) == {"baseline", "megatrain"}, [(r["key"], r["error"]) for r in report["results"]]
    for row in rows.values():
        assert row["error"] is None and math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert math.isfinite(row["loss"])
    assert rows["baseline"]["settings"]["hf_class"] == "Qwen2MoeForCausalLM"
    assert rows["baseline"]["flops_per_token"] == rows["megatrain"]["flops_per_token"]  # the same model counted
    assert rows["megatrain"]["moe"]["worst_layer_max_over_mean"] >= 1.0
    prof = report["moe_profile"]
    assert prof["by_part_ms"]["grouped_gemm"] > 0 and prof["by_part_ms"]["routing"] > 0
    assert prof["by_part_ms"]["permutation"] > 0 and prof["by_part_ms"]["all_to_all"] == 0
    summary = report["summary"]
    assert summary["speedup"] == pytest.approx(rows["megatrain"]["tokens_per_s"] / rows["baseline"]["tokens_per_s"])
    assert len(summary["targets"]) == 3
    assert "target speedup >= 1.5:" in proc.stdout and "expert load max/mean" in proc.stdout
    # the load of steps right after initialisation is shown, never judged against the after-warm-up target
    assert summary["targets"]["expert load max/mean <= 1.25 after warm-up"] is None
    assert "after warm-up: n/a here (an untrained router" in proc.stdout


@pytest.mark.slow
def test_the_trainer_profile_runs_on_cpu_and_records_the_routing_skew(tmp_path):
    """mfu.py --only kernels: the trainer's step under the profiler, with --forward-probe (a
    CUDA-only look, skipped on a CPU rather than failing the profile), and the profiled step's
    expert load per layer."""
    out = tmp_path / "mfu.json"
    cmd = [sys.executable, "benchmarks/mfu.py", "--quick", "--device", "cpu", "--config", "configs/moe-gpu-2b.yaml",
           "--out", str(out), "--only", "kernels", "--forward-probe", "--default-mbs", "2", "--large-batch", "4",
           "--source-bytes", "100000", "--override", "model.compile=false", "--override", "train.micro_batch_size=2",
           *[a for o in TINY for a in ("--override", o)]]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    profile = json.loads(out.read_text())["profile"]
    assert "error" not in profile, profile.get("error")
    assert profile["wall_ms"] > 0 and "forward_probe" not in profile  # no CUDA kernels to compare here
    skew = profile["moe_max_over_mean"]
    assert skew and all(value >= 1.0 for value in skew.values())
