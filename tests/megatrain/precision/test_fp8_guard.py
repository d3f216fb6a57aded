"""The FP8 guard: the converted weights' amax and e4m3 underflow, measured as the forward cast
sees them, and the anomaly detector's verdicts on them (so an FP8 divergence rolls back)."""

import math

import pytest
import torch

from megatrain.config import AnomalyConfig
from megatrain.config import load_config
from megatrain.model.gpt import GPT
from megatrain.precision import FP8Guard, apply_precision, fp8_linears
from megatrain.reliability.anomaly import AnomalyDetector

SMALL = ["model.vocab_size=256", "model.n_layer=2", "model.n_head=2", "model.d_model=64", "model.seq_len=32",
         "train.precision=fp8", "train.fp8.emulate=true"]


@pytest.fixture
def model():
    cfg = load_config(None, SMALL)
    torch.manual_seed(0)
    return apply_precision(GPT(cfg.model), cfg)


def _guard(model) -> FP8Guard:
    return FP8Guard(model, enabled=True, device=torch.device("cpu"))


def test_healthy_weights_have_finite_amax_and_almost_no_underflow(model):
    stats = _guard(model).stats()
    amaxes = [m.weight.abs().max().item() for _, m in fp8_linears(model)]
    assert stats["fp8_amax_max"] == pytest.approx(max(amaxes)) and stats["fp8_amax_min"] == pytest.approx(min(amaxes))
    assert stats["fp8_nonfinite"] == 0 and stats["fp8_underflow"] < 1e-3


def test_an_outlier_weight_shows_as_underflow(model):
    """One weight 1e6x the rest (e4m3 spans 448 / 2^-9 ~ 2.3e5): the tensorwise scale 448/amax flushes
    the bulk of that tensor to zero."""
    linears = [m for _, m in fp8_linears(model)]
    with torch.no_grad():
        linears[0].weight[0, 0] = 1e6 * linears[0].weight.abs().max()
    stats = _guard(model).stats()
    share = linears[0].weight.numel() / sum(m.weight.numel() for m in linears)
    # the flushed weights are exactly those a real e4m3 cast at that scale turns into zeros
    w = linears[0].weight.detach()
    flushed = ((w * (448 / w.abs().max())).to(torch.float8_e4m3fn).float() == 0).sum().item()
    total_nonzero = sum((m.weight != 0).sum().item() for m in linears)
    assert stats["fp8_underflow"] == pytest.approx(flushed / total_nonzero)
    assert stats["fp8_underflow"] > 0.5 * share


def test_a_nonfinite_weight_is_counted(model):
    with torch.no_grad():
        fp8_linears(model)[1][1].weight[3, 2] = float("inf")
    stats = _guard(model).stats()
    assert stats["fp8_nonfinite"] == 1 and math.isinf(stats["fp8_amax_max"])


def test_guard_interval_and_disabled():
    cfg = load_config(None, SMALL)
    guard = FP8Guard(GPT(cfg.model), enabled=False, device=torch.device("cpu"))
    assert not guard.due(1) and guard.linears == []
    every_3 = FP8Guard(apply_precision(GPT(cfg.model), cfg), enabled=True, device=torch.device("cpu"), interval=3)
    assert [s for s in range(1, 10) if every_3.due(s)] == [3, 6, 9]


def test_detector_turns_fp8_trouble_into_verdicts():
    detector = AnomalyDetector(AnomalyConfig(fp8_max_underflow=0.05))
    healthy = {"fp8_amax_max": 0.1, "fp8_amax_min": 0.05, "fp8_nonfinite": 0.0, "fp8_underflow": 1e-5}
    assert detector.observe(1, 3.0, 1.0, healthy) is None
    underflow = detector.observe(2, 3.0, 1.0, {**healthy, "fp8_underflow": 0.2})
    assert underflow.kind == "fp8_underflow" and underflow.value == 0.2 and "20.00% of the FP8 weights" in underflow.message
    amax = detector.observe(3, 3.0, 1.0, {**healthy, "fp8_nonfinite": 2.0, "fp8_amax_max": float("inf")})
    assert amax.kind == "fp8_amax" and "2 FP8 linear(s)" in amax.message
    # a verdict round-trips through the file the orchestrator reads
    from megatrain.reliability.anomaly import Verdict

    assert Verdict.from_json(amax.to_json()) == amax
    assert detector.observe(4, 3.0, 1.0, None) is None  # steps the guard skipped
