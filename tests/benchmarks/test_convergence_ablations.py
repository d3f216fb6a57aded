"""benchmarks/convergence_ablations.py at a tiny size on the CPU: every arm reads the same token
stream at equal tokens (a batch<k> arm reads k baseline batches a step), the modifiers reach the
model and optimizer they name, and the summary's differences and seed band are computed from the
curves. And convergence_report.time_to_target on curves whose answer is known."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import convergence_ablations as ablations  # noqa: E402
import convergence_report  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("ablations")
    args = ablations.parse_args([
        "--family", "llama", "--shape", "tiny", "--steps", str(STEPS), "--batch", "2", "--lr", "1e-3",
        "--min-lr", "1e-4", "--warmup", "2", "--eval-every", "4", "--val-windows", "4", "--max-source-bytes", "200000",
        "--doc-roots", "", "--num-workers", "1", "--work", str(work), "--out", str(work / "result"), "--device", "cpu",
        "--arms", "base,base+seed1,parallel,window16,lamb+batch2+lr4e-3,moe"])
    return ablations.run_ablations(args, log=lambda msg: None)


def test_every_arm_reads_the_same_tokens_in_the_same_order(report):
    arms = report["arms"]
    base = arms["base"]["batch_crc32"]
    assert len(base) == STEPS and len(set(base)) > 1
    for name, arm in arms.items():
        assert arm["batch_crc32"] == base, name
        assert arm["steps"] * arm["tokens_per_step"] == report["tokens"], name
        assert [p["tokens"] for p in arm["val"]] == [0, report["tokens"] // 2, report["tokens"]], name
    assert arms["lamb+batch2+lr4e-3"]["steps"] == STEPS // 2 and arms["lamb+batch2+lr4e-3"]["batch"] == 4


def test_modifiers_reach_the_model_and_the_optimizer(report):
    arms = report["arms"]
    assert arms["base"]["model"]["block"] == "serial" and arms["parallel"]["model"]["block"] == "parallel"
    assert arms["window16"]["model"]["attention"] == "sliding" and arms["window16"]["model"]["window"] == 16
    lamb = arms["lamb+batch2+lr4e-3"]["optim"]
    assert (lamb["name"], lamb["lr"], lamb["warmup_steps"]) == ("lamb", 4e-3, 1)
    assert arms["moe"]["model"]["mlp"] == "moe" and arms["moe"]["model"]["moe"]["top_k"] == 8
    # equal active FLOPs per token: top-k experts of d_ff / k each
    assert arms["moe"]["model"]["moe"]["expert_d_ff"] * 8 == arms["base"]["model"]["d_ff"]
    assert arms["moe"]["params"] > arms["base"]["params"]
    assert arms["base+seed1"]["init_seed"] == 1


def test_arms_differ_and_the_summary_follows_the_curves(report):
    s = report["summary"]
    final = s["final_val_loss"]
    assert set(final) == set(report["arms"])
    assert len({round(v, 6) for v in final.values()}) == len(final)  # every modifier changed the run
    for name, arm in report["arms"].items():
        assert arm["val"][-1]["loss"] < arm["val"][0]["loss"], name  # each learned something
        assert s["minus_base"][name] == pytest.approx(final[name] - final["base"])
    assert s["seed_band"] == pytest.approx(abs(final["base"] - final["base+seed1"]))
    assert s["best_of_sweep"]["lamb+batch2"]["arm"] == "lamb+batch2+lr4e-3"
    table = ablations.table(report)
    assert "| moe |" in table and "seed band" in table


def test_an_unknown_modifier_is_refused_before_anything_runs():
    args = ablations.parse_args(["--shape", "tiny", "--steps", "8", "--warmup", "2", "--eval-every", "4"])
    from convergence_models import model_config

    with pytest.raises(SystemExit, match="unknown modifier 'widow16'"):
        ablations.parse_arm("base+widow16", "gpt", model_config("gpt", "tiny"), args)
    with pytest.raises(SystemExit, match="multiples of batch3"):
        ablations.parse_arm("batch3", "gpt", model_config("gpt", "tiny"), args)


def _run(val, step_s):
    return {"val": [{"step": s, "tokens": s * 10, "loss": loss} for s, loss in val], "step_s_mean": step_s,
            "train_loss": [], "impl": "x", "init_seed": 0}


def test_time_to_target_interpolates_the_crossing_and_gives_both_ratios():
    report = {"tokens_per_step": 10, "runs": {
        "peer": _run([(0, 5.0), (100, 3.0), (200, 2.0)], 0.2),
        "fast": _run([(0, 5.0), (100, 2.5), (200, 1.5)], 0.1),  # reaches 2.0 at step 150, twice the step rate
        "slow": _run([(0, 5.0), (100, 4.0), (200, 3.0)], 0.1)}}  # never does
    out = convergence_report.time_to_target(report, "peer")
    assert out["target_loss"] == 2.0 and out["target_tokens"] == 2000
    fast = out["runs"]["fast"]
    assert fast["reached_at_step"] == pytest.approx(150.0) and fast["wall_s"] == pytest.approx(15.0)
    assert fast["speedup_tokens_per_s"] == pytest.approx(2.0) and fast["speedup_time_to_target"] == pytest.approx(40 / 15)
    assert out["runs"]["peer"]["speedup_time_to_target"] == pytest.approx(1.0)
    assert out["runs"]["slow"]["wall_s"] is None and out["runs"]["slow"]["speedup_tokens_per_s"] == pytest.approx(2.0)
    with pytest.raises(SystemExit, match="no such run"):
        convergence_report.time_to_target(report, "nobody")
    # a target before the end: the peer's loss after 100 steps (3.0), which "slow" reaches at 200
    early = convergence_report.time_to_target(report, "peer", at_step=100)
    assert early["target_loss"] == 3.0 and early["target_tokens"] == 1000
    assert early["runs"]["slow"]["reached_at_step"] == pytest.approx(200.0)
    assert early["runs"]["slow"]["speedup_time_to_target"] == pytest.approx(20 / 20)
    assert early["runs"]["fast"]["reached_at_step"] == pytest.approx(100 * 2.0 / 2.5)
    with pytest.raises(SystemExit, match="no evaluation there"):
        convergence_report.time_to_target(report, "peer", at_step=150)


def test_the_band_over_several_peer_seeds_is_the_widest_pair():
    """Three peer seeds: the band is the widest |peer:i - peer:j|, not peer:0 - peer:1's; the same-start
    gap is the widest megatrain:k - peer:k; with two seeds there is no such entry."""
    curve = lambda *losses: _run([(0, 5.0)] + [(100 * (i + 1), x) for i, x in enumerate(losses)], 0.1)  # noqa: E731
    runs = {"megatrain": curve(3.00, 2.00), "peer:0": curve(3.01, 2.00), "peer:1": curve(3.02, 2.01),
            "peer:2": curve(2.95, 2.03), "megatrain:2": curve(2.90, 2.03)}
    out = convergence_report.verdict(runs)
    band = out["band_all_seeds"]
    assert band["seeds"] == [0, 1, 2] and band["pair"] == "peer:1-peer:2" and band["max"] == pytest.approx(0.07)
    assert band["same_start_pair"] == "megatrain:2-peer:2" and band["same_start_max"] == pytest.approx(0.05)
    assert out["within_band_all_seeds"] is True
    assert out["band_max_abs_diff_peer0_peer1"] == pytest.approx(0.01)  # two seeds alone: 0.05 would be outside
    runs["megatrain:2"] = curve(2.85, 2.03)  # 0.10 from its peer: outside even the wider band
    assert convergence_report.verdict(runs)["within_band_all_seeds"] is False
    del runs["peer:2"], runs["megatrain:2"]
    assert "band_all_seeds" not in convergence_report.verdict(runs)
    assert "band over peer seeds" in convergence_report.table({"tokens_per_step": 10, "runs": {}, "verdict": out})
