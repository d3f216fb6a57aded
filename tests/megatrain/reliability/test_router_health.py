"""A collapsing MoE router is an anomaly like a loss spike (megatrain/reliability/anomaly.py's
RouterHealth): one expert serving most of a layer's tokens, or an expert with none, for
``router_collapse_steps`` steps in a row. The health rows come from the real model's ``end_step``
where it matters, and the planted fault (``collapse_router``) forces the real routers."""

from __future__ import annotations

import pytest
import torch

from megatrain.config import AnomalyConfig, FaultConfig
from megatrain.config.model import ModelConfig, MoEConfig
from megatrain.model import GPT
from megatrain.model.moe import end_step
from megatrain.reliability.anomaly import AnomalyDetector, Verdict, read_verdict, write_verdict
from megatrain.reliability.faults import FaultInjector, collapse_routers

BALANCED = [0.125] * 8


def health(*layers: list[float]) -> dict:
    """An ``end_step`` result with these shares for MoE layers 1, 2, ..."""
    return {"layers": {str(i + 1): {"share": share, "entropy": 1.0, "max_over_mean": max(share) * len(share)}
                       for i, share in enumerate(layers)}, "aux_loss": 1.0, "z_loss": 0.0, "max_over_mean": 1.0}


def run(detector: AnomalyDetector, rows: list[dict], loss: float = 3.0) -> Verdict | None:
    for step, moe in enumerate(rows, start=1):
        verdict = detector.observe(step, loss, 1.0, moe=moe)
        if verdict is not None:
            return verdict
    return None


# top-2 of 8: a collapsed layer sends every token to experts 0 and 1 (half the slots each)
COLLAPSED = [0.5, 0.5] + [0.0] * 6
SKEWED = [0.47, 0.03, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]  # expert 0 serves 94% of the tokens, none dead


def test_a_collapse_lasting_the_streak_is_a_verdict_naming_layer_expert_and_share():
    cfg = AnomalyConfig(router_collapse_steps=3, dead_experts=False)
    verdict = run(AnomalyDetector(cfg, moe_top_k=2), [health(BALANCED, BALANCED)] * 5 + [health(BALANCED, SKEWED)] * 3)
    assert verdict is not None and verdict.kind == "router_collapse"
    assert (verdict.step, verdict.layer, verdict.expert) == (8, 2, 0)
    assert verdict.value == pytest.approx(0.94) and verdict.baseline == pytest.approx(0.25)
    assert "layer 2: expert 0 took 94.0% of the tokens (47.0% of the routed slots) for 3 steps" in verdict.message


def test_a_shorter_collapse_and_a_balanced_router_are_not_anomalies():
    cfg = AnomalyConfig(router_collapse_steps=3)
    broken = [health(SKEWED)] * 2 + [health(BALANCED)] + [health(SKEWED)] * 2  # the streak restarts
    assert run(AnomalyDetector(cfg, moe_top_k=2), broken) is None
    assert run(AnomalyDetector(AnomalyConfig(), moe_top_k=2), [health(BALANCED)] * 200) is None
    # one expert at 80% of the tokens (share 0.4 of top-2 slots) is skewed but under the default 0.9
    assert run(AnomalyDetector(AnomalyConfig(), moe_top_k=2), [health([0.4] + [0.6 / 7] * 7)] * 100) is None


def test_dead_experts_are_a_verdict_and_each_check_can_be_turned_off():
    cfg = AnomalyConfig(router_collapse_steps=4, router_collapse_share=None)
    starving = [0.25, 0.25, 0.25, 0.25 - 1e-6, 1e-6, 0.0, 0.0, 0.0]
    verdict = run(AnomalyDetector(cfg, moe_top_k=2), [health(starving)] * 4)
    assert verdict is not None and verdict.kind == "dead_expert" and (verdict.layer, verdict.expert) == (1, 5)
    assert "experts 5, 6, 7 routed no token for 4 steps in a row" in verdict.message
    off = AnomalyConfig(router_collapse_steps=4, router_collapse_share=None, dead_experts=False)
    assert run(AnomalyDetector(off, moe_top_k=2), [health(COLLAPSED)] * 10) is None


def test_a_collapse_is_named_before_the_dead_experts_it_leaves():
    verdict = run(AnomalyDetector(AnomalyConfig(router_collapse_steps=2), moe_top_k=2), [health(COLLAPSED)] * 2)
    assert verdict is not None and verdict.kind == "router_collapse" and verdict.expert == 0 and verdict.value == 1.0


def test_dense_models_and_all_expert_routing_are_never_judged():
    rows = [health(COLLAPSED)] * 50
    assert run(AnomalyDetector(AnomalyConfig(router_collapse_steps=2)), rows) is None  # no top_k: a dense model
    # top_k = n_experts: every token uses every expert, a share of 1 is the only possible one
    assert run(AnomalyDetector(AnomalyConfig(router_collapse_steps=2, dead_experts=False), moe_top_k=8), rows) is None


def test_a_nan_loss_still_comes_first_and_the_verdict_round_trips(tmp_path):
    detector = AnomalyDetector(AnomalyConfig(router_collapse_steps=1), moe_top_k=2)
    assert detector.observe(1, float("nan"), 1.0, moe=health(COLLAPSED)).kind == "nan_loss"
    verdict = detector.observe(2, 3.0, 1.0, moe=health(COLLAPSED))
    write_verdict(tmp_path, verdict)
    assert read_verdict(tmp_path) == verdict and read_verdict(tmp_path).layer == 1


def tiny_moe() -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, seq_len=32, position="rope",
                      norm="rmsnorm", mlp="moe", bias=False, block="serial", d_ff=96,
                      moe=MoEConfig(n_experts=8, top_k=2, expert_d_ff=32))
    return GPT(cfg).train()


def step_health(model: GPT) -> dict:
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    model(ids, ids)
    return end_step(model)


def test_the_planted_fault_collapses_the_real_routers_from_its_step_on(tmp_path):
    """FaultInjector with ``collapse_router`` at step 3: steps 1-2 route as trained, from step 3 on
    every token goes to experts 0 and 1 of each layer, and the detector stops the run at 3 + N - 1."""
    model = tiny_moe()
    faults = FaultInjector([FaultConfig(kind="collapse_router", step=3)], rank=0, run_dir=tmp_path, model=model)
    detector = AnomalyDetector(AnomalyConfig(router_collapse_steps=2), moe_top_k=2)
    verdicts = {}
    for step in range(1, 6):
        faults.on_step_start(step)
        moe = step_health(model)
        verdicts[step] = detector.observe(step, 5.0, 1.0, moe=moe)
        if verdicts[step] is not None:
            break
        if step < 3:
            assert max(max(h["share"]) for h in moe["layers"].values()) < 0.5, moe  # a fresh router spreads
        else:
            assert [h["share"][:2] for h in moe["layers"].values()] == [[0.5, 0.5]] * 2
    assert faults.fired == [(3, "collapse_router")] and (tmp_path / "faults").is_dir()  # claimed once
    verdict = verdicts[4]
    assert verdict is not None and (verdict.kind, verdict.layer, verdict.expert, verdict.value) == ("router_collapse", 0, 0, 1.0)


def test_collapse_router_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="no MoE router"):
        collapse_routers(torch.nn.Linear(2, 2))


def test_no_router_verdict_during_the_routers_warm_up_then_the_full_streak():
    """A fresh router is skewed and leaves experts idle (moe-gpu-2b on an H200: experts with no
    token for 20 steps from step 1, max/mean load 6.5 at init); the checks start after the LR
    warm-up unless ``router_warmup_steps`` says otherwise, and a streak counts from there."""
    rows = [health(COLLAPSED)] * 40
    cfg = AnomalyConfig(router_collapse_steps=5)
    verdict = run(AnomalyDetector(cfg, moe_top_k=2, lr_warmup_steps=30), rows)
    assert verdict is not None and verdict.step == 35  # steps 31..35: the first full streak after step 30
    assert run(AnomalyDetector(cfg, moe_top_k=2, lr_warmup_steps=40), rows) is None
    explicit = AnomalyConfig(router_collapse_steps=5, router_warmup_steps=0)
    assert run(AnomalyDetector(explicit, moe_top_k=2, lr_warmup_steps=30), rows).step == 5
