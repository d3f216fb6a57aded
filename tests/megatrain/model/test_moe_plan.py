"""MoE beyond the layer: ``megatrain plan`` counts every expert's state and the active share, the
expert-load health reaches the tracking sinks' scalars, export refuses by naming model.mlp, and
a MoE model's parameters and aux-free biases survive a save and load."""

from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.interop.hf_config import ExportRefused, family_for
from megatrain.model import (
    GPT,
    active_parameter_count,
    count_parameters,
    expected_parameter_count,
)
from megatrain.model.moe import MoE, end_step
from megatrain.observe.metrics import StepMetrics, scalars
from megatrain.parallel.plan import GIB, format_plan, memory_plan, params_per_gpu

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_plan_counts_all_experts_and_reports_the_active_share():
    cfg = load_config(CONFIGS / "moe-olmoe-1b-7b.yaml")
    total, active = expected_parameter_count(cfg.model), active_parameter_count(cfg.model)
    # by hand: 16 layers x (attention 4 d^2 + router 64 d + 64 experts x 3 d eff + 2 norms d) + 2 V d + d
    d, eff, V = 2048, 1024, 50304
    layer = 4 * d * d + 64 * d + 64 * 3 * d * eff + 2 * d
    assert total == 16 * layer + 2 * V * d + d == 6_919_096_320  # OLMoE-1B-7B: "6.9B"
    assert active == total - 16 * 56 * 3 * d * eff == 1_281_951_744  # "1.3B active"
    plan = memory_plan(cfg, world_size=256)
    assert plan.params == total  # every expert on every GPU (no expert parallelism yet)
    assert plan.optimizer_bytes == pytest.approx(12 * total / 256)  # ZeRO-1 over 256 ranks
    assert "6.92 B parameters in total, 1.28 B active per token" in format_plan(plan)
    small = load_config(CONFIGS / "moe-gpu-2b.yaml")
    assert params_per_gpu(small, tp=1, pp=1) == expected_parameter_count(small.model)
    assert memory_plan(small).total_bytes < 75 * GIB  # one H100 with its optimizer state
    with pytest.raises(ValueError, match="tensor-parallel experts"):
        memory_plan(load_config(CONFIGS / "moe-gpu-2b.yaml", ["parallel.tp=2"]), world_size=2)


def test_plan_of_a_pipeline_stage_counts_its_routed_layers():
    cfg = load_config(CONFIGS / "moe-tiny-cpu.yaml", ["model.n_layer=4", "parallel.pp=2"])  # layers 1-3 routed
    stage = params_per_gpu(cfg)  # the busiest stage holds two routed layers (2, 3)
    dense = params_per_gpu(load_config(CONFIGS / "llama-tiny-cpu.yaml", ["model.n_layer=4", "parallel.pp=2"]))
    gpt = GPT(cfg.model)
    moe, swiglu = gpt.blocks[3].mlp, gpt.blocks[0].mlp
    routed_extra = count_parameters(moe) - count_parameters(swiglu)
    assert stage == dense + 2 * routed_extra


def test_expert_load_health_reaches_the_tracking_scalars():
    cfg = load_config(CONFIGS / "moe-tiny-cpu.yaml").model
    torch.manual_seed(0)
    model = GPT(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).backward()
    health = end_step(model)
    values = scalars(StepMetrics(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=32, step_time_s=0.1,
                                 tokens_per_s=320.0, moe=health))
    shares = [values[f"moe/layer1/share/expert{e}"] for e in range(8)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3) and max(shares) * 8 == pytest.approx(values["moe/max_over_mean"], rel=1e-4)
    assert 0 < values["moe/layer1/entropy"] <= torch.log(torch.tensor(8.0)).item()
    assert values["moe/aux_loss"] > 0.5 and values["moe/z_loss"] > 0
    assert not any(k.startswith("moe/layer0") for k in values)  # layer 0 is dense
    assert end_step(model)["layers"]["1"]["share"] == [0.0] * 8  # statistics reset each step


def test_export_is_refused_naming_model_mlp():
    cfg = load_config(CONFIGS / "moe-tiny-cpu.yaml").model
    with pytest.raises(ExportRefused, match="model.mlp=moe"):
        family_for(cfg)


def test_a_saved_moe_model_loads_with_its_router_biases(tmp_path):
    cfg = load_config(CONFIGS / "moe-tiny-cpu.yaml", ["model.moe.load_balance=aux_free"]).model
    torch.manual_seed(0)
    model = GPT(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        model(idx, idx)
    end_step(model)  # moves the biases
    torch.save(model.state_dict(), tmp_path / "model.pt")
    restored = GPT(cfg)
    restored.load_state_dict(torch.load(tmp_path / "model.pt"))
    bias = next(m for m in restored.modules() if isinstance(m, MoE)).router.bias
    assert bias.abs().sum() > 0
    restored.eval(), model.eval()
    torch.testing.assert_close(restored(idx, idx), model(idx, idx))
