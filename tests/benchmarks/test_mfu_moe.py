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


def test_the_baseline_starts_from_megatrains_exported_weights(tmp_path):
    """mfu.py --init-from: HFMoE(weights=folder) holds the exported model, the same loss on the same
    tokens (without the load-balancing term, which megatrain keeps out of its loss); transformers'
    own init does not."""
    from tokenizers import Tokenizer, models

    from megatrain.interop.hf import export_model

    cfg = tiny_cfg()
    torch.manual_seed(0)
    ours = GPT(cfg.model)
    vocab = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>")).to_str().encode()
    folder = export_model(ours, cfg.model, tmp_path / "hf", vocab)
    idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours.eval()(idx, idx).item()
        loaded = mfu_moe.HFMoE(cfg.model, cfg.seq_len, aux_loss=False, weights=str(folder)).eval()(idx, idx).item()
        fresh = mfu_moe.HFMoE(cfg.model, cfg.seq_len, aux_loss=False).eval()(idx, idx).item()
    assert loaded == pytest.approx(want, abs=1e-4)
    assert abs(fresh - want) > 1e-3


@pytest.mark.parametrize("init_from, load, verdict", [(None, 1.1, None), ("warm/hf", 1.1, True), ("warm/hf", 1.4, False)])
def test_the_load_target_is_judged_only_from_warmed_up_weights(init_from, load, verdict):
    """summarize_moe: the timed steps' expert load meets "<= 1.25 after warm-up" or not only when both
    sides start from a warmed-up run (mfu.py --init-from); from a random init it is shown, not judged."""
    from types import SimpleNamespace

    from mfu_report import Result

    moe = {"mean_layer_max_over_mean": load, "worst_layer_max_over_mean": load + 0.2}
    bench = SimpleNamespace(args=SimpleNamespace(init_from=init_from), results=[
        Result(key="baseline-mb2", label="b", kind="baseline", micro_batch=2, global_batch=4, tokens_per_s=100.0, loss=3.0),
        Result(key="default-mb2", label="m", kind="megatrain", micro_batch=2, global_batch=4, tokens_per_s=160.0,
               mfu=0.45, loss=2.9, moe=moe)])
    out = mfu_moe.summarize_moe(bench, on_cuda=True)
    assert out["targets"]["expert load max/mean <= 1.25 after warm-up"] is verdict
    assert out["targets"]["speedup >= 1.5"] is True and out["speedup"] == pytest.approx(1.6)
    assert any("loss after the timed steps: baseline-mb2 3.000, default-mb2 2.900" in line
               for line in out["lines"]) == (init_from is not None)


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
    from mfu_report import load_balance  # the report's, below both runners (no import circle)

    got = load_balance([None, health(1.5, 1.1), health(1.2, 1.3)])
    assert got["steps"] == 2
    assert got["worst_layer_max_over_mean"] == 1.3 and got["mean_layer_max_over_mean"] == pytest.approx(1.25)
    assert got["worst_over_steps"] == 1.5 and got["mean_over_steps"] == pytest.approx(1.275)
    assert load_balance([None]) is None


def test_an_unknown_variant_is_refused_before_any_row_runs(capsys):
    import mfu

    assert mfu.parse_args(["--variants", "ds-norms,router-reference"]).variants == ["ds-norms", "router-reference"]
    with pytest.raises(SystemExit) as exc:
        mfu.parse_args(["--variants", "ds-norms,no-such-row"])
    assert exc.value.code == 2 and "--variants: unknown no-such-row" in capsys.readouterr().err


@pytest.mark.slow
def test_moe_benchmark_runs_both_rows_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    cmd = [sys.executable, "benchmarks/mfu.py", "--quick", "--device", "cpu", "--config", "configs/moe-gpu-2b.yaml",
           "--out", str(out), "--baseline-eager", "--default-mbs", "2", "--large-batch", "4", "--steps", "1", "--source-bytes", "100000",
           "--variants", "no-overlap-comm", "--override", "model.compile=false", "--override", "train.micro_batch_size=2", *[a for o in TINY for a in ("--override", o)]]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["results"]}
    assert set(rows) == {"baseline-mb2", "default-mb2", "default-mb2-no-overlap-comm"}, \
        [(r["key"], r["error"]) for r in report["results"]]
    assert rows.pop("default-mb2-no-overlap-comm")["error"] is None  # a --variants row, after the default
    rows = {r["kind"]: r for r in rows.values()}
    for row in rows.values():
        assert row["error"] is None and math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert math.isfinite(row["loss"])
    assert rows["baseline"]["settings"]["hf_class"] == "Qwen2MoeForCausalLM"
    # the MoE baseline trains with the recipe's schedule: after its compile, warm and timed step, the
    # lr of megatrain's scheduler three steps in (mfu.py runs every row with train.steps=100000)
    from megatrain.optim import lr_at

    optim = tiny_cfg().optim
    assert rows["baseline"]["settings"]["lr_after_timed_steps"] == pytest.approx(lr_at(3, optim, 100000))
    assert 0 < lr_at(3, optim, 100000) < optim.lr / 100  # the recipe's warm-up, not a constant 6e-4
    assert rows["baseline"]["flops_per_token"] == rows["megatrain"]["flops_per_token"]  # the same model counted
    assert rows["megatrain"]["moe"]["worst_layer_max_over_mean"] >= 1.0
    prof = report["moe_profile"]
    assert prof["by_part_ms"]["grouped_gemm"] > 0 and prof["by_part_ms"]["routing"] > 0
    assert prof["by_part_ms"]["permutation"] > 0 and prof["by_part_ms"]["all_to_all"] == 0
    summary = report["summary"]
    fastest = max(r["tokens_per_s"] for r in report["results"] if r["kind"] == "megatrain")  # the variant counts too
    assert summary["speedup"] == pytest.approx(fastest / rows["baseline"]["tokens_per_s"])
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
    assert profile["idle_by_phase_ms"] == {}  # nor GPU gaps
    skew = profile["moe_max_over_mean"]
    assert skew and all(value >= 1.0 for value in skew.values())
