"""Anomaly detectors: each kind is caught, a normal noisy curve is not, verdicts round-trip."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from megatrain.config import AnomalyConfig
from megatrain.reliability.anomaly import AnomalyDetector, Verdict, clear_verdict, read_verdict, write_verdict


def noisy_curve(steps: int, seed: int = 0) -> list[float]:
    """A realistic loss: fast then slow decay, 3% multiplicative noise."""
    rng = random.Random(seed)
    return [(2.0 + 8.0 * math.exp(-step / 60)) * (1 + rng.gauss(0, 0.03)) for step in range(steps)]


def feed(detector: AnomalyDetector, losses: list[float], grad: float = 1.0) -> Verdict | None:
    for step, loss in enumerate(losses):
        verdict = detector.observe(step, loss, grad)
        if verdict is not None:
            return verdict
    return None


@pytest.mark.parametrize("seed", range(5))
def test_normal_noisy_curve_gives_no_verdict(seed: int) -> None:
    assert feed(AnomalyDetector(AnomalyConfig(grad_norm_zscore=8.0)), noisy_curve(600, seed)) is None


@pytest.mark.parametrize("bad, kind", [(float("nan"), "nan_loss"), (float("inf"), "inf_loss")])
def test_non_finite_loss(bad: float, kind: str) -> None:
    detector = AnomalyDetector(AnomalyConfig())
    assert feed(detector, noisy_curve(5)) is None  # caught even during warm-up
    verdict = detector.observe(5, bad, 1.0)
    assert verdict is not None and verdict.kind == kind and verdict.step == 5


def test_loss_spike() -> None:
    detector = AnomalyDetector(AnomalyConfig())
    losses = noisy_curve(200)
    assert feed(detector, losses) is None
    verdict = detector.observe(200, losses[-1] * 2, 1.0)
    assert verdict is not None and verdict.kind == "loss_spike"
    recent = sorted(losses[-50:])
    assert verdict.zscore > 6 and verdict.baseline == pytest.approx((recent[24] + recent[25]) / 2)
    # the spike stayed out of the window: the next normal step is fine
    assert detector.observe(201, losses[-1], 1.0) is None


def test_no_spike_verdict_during_warmup() -> None:
    detector = AnomalyDetector(AnomalyConfig(warmup_steps=20))
    for step in range(15):
        assert detector.observe(step, 2.0 + 0.01 * (step % 3)) is None
    assert detector.observe(15, 20.0) is None
    assert detector.observe(25, 20.0).kind == "loss_spike"


def test_grad_explosion() -> None:
    absolute = AnomalyDetector(AnomalyConfig(grad_norm_max=100.0))
    assert absolute.observe(3, 2.0, 50.0) is None
    assert absolute.observe(4, 2.0, 500.0).kind == "grad_explosion"
    assert absolute.observe(5, 2.0, float("nan")).kind == "nan_grad_norm"

    relative = AnomalyDetector(AnomalyConfig(grad_norm_zscore=8.0))
    rng = random.Random(1)
    for step in range(100):
        assert relative.observe(step, 2.0, 1.0 + rng.gauss(0, 0.05)) is None
    verdict = relative.observe(100, 2.0, 30.0)
    assert verdict.kind == "grad_explosion" and verdict.zscore > 8


def test_verdict_file_round_trip(tmp_path: Path) -> None:
    assert read_verdict(tmp_path) is None
    verdict = Verdict("nan_loss", 12, float("nan"), 2.5, "step 12: loss is nan")
    text = verdict.to_json()
    assert "NaN" not in text  # strict JSON
    write_verdict(tmp_path, verdict)
    back = read_verdict(tmp_path)
    assert back.kind == "nan_loss" and back.step == 12 and math.isnan(back.value) and back.baseline == 2.5
    assert Verdict.from_json(Verdict("inf_loss", 1, float("inf"), None, "x").to_json()).value == float("inf")
    clear_verdict(tmp_path)
    assert read_verdict(tmp_path) is None
