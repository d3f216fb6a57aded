"""configs/moe-tiny-cpu.yaml end to end: the real trainer, real text (the standard library's
source through the data pipeline), DeepSpeed; the loss must fall clearly in 100 steps, and every
step's row carries the routed layer's expert-load health (megatrain/model/moe.py's end_step)."""

import math
from pathlib import Path

import pytest

MOE_TINY = Path(__file__).resolve().parents[3] / "configs" / "moe-tiny-cpu.yaml"


@pytest.mark.slow
def test_moe_tiny_loss_falls_clearly_in_100_steps_with_expert_load_in_every_row(run_training):
    metrics, _ = run_training(["data.max_source_bytes=1000000", "checkpoint.interval=1000"], config=MOE_TINY)
    assert [m["step"] for m in metrics] == list(range(1, 101))
    first = sum(m["loss"] for m in metrics[:10]) / 10
    last = sum(m["loss"] for m in metrics[-10:]) / 10
    end = metrics[-1]
    print(f"moe-tiny-cpu: loss {metrics[0]['loss']:.3f} -> {end['loss']:.3f}, first/last 10 {first:.3f} -> {last:.3f}, "
          f"health {end['moe']}, {sum(m['step_time_s'] for m in metrics):.1f} s in steps")
    assert first > 6.5  # ~ln(2048) = 7.6 nats at the start
    assert last < first - 1.5, (first, last)
    for row in (metrics[0], metrics[-1]):
        health = row["moe"]["layers"]
        assert list(health) == ["1"]  # layer 0 is dense (moe.dense_layers 1)
        share = health["1"]["share"]
        assert len(share) == 8 and abs(sum(share) - 1) < 1e-3
        assert 0 < health["1"]["entropy"] <= math.log(8) + 1e-6
    assert metrics[-1]["moe"]["max_over_mean"] < 2.0, metrics[-1]["moe"]  # the aux loss keeps no expert starved of work
    assert 0.9 < metrics[-1]["moe"]["aux_loss"] < 1.5


@pytest.mark.slow
def test_moe_resumes_like_one_run_router_biases_included(run_training):
    """3 steps, a checkpoint, 3 more: the same losses and expert loads as 6 straight steps. The
    aux-free biases move fast here (rate 0.05), so a resume that lost them would route differently."""
    common = ["data.max_source_bytes=1000000", "model.moe.load_balance=aux_free", "model.moe.bias_update_rate=0.05",
              "checkpoint.interval=3", "optim.decay_steps=6", "data.prefetch_batches=0"]
    straight, _ = run_training([*common, "train.steps=6"], config=MOE_TINY, name="straight")
    run_training([*common, "train.steps=3"], config=MOE_TINY, name="resumed")
    resumed, _ = run_training([*common, "train.steps=6"], config=MOE_TINY, name="resumed")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(straight, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        assert a["moe"]["layers"] == b["moe"]["layers"]
