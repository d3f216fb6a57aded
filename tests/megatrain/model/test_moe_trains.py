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
