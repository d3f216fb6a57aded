"""FP8 conversion on CPU (torchao's emulation: FP8 casts, high-precision GEMM): which linears
convert and which stay, that every converted linear really runs in the forward, that the FP8
model computes the bf16 model's function to FP8 accuracy, that checkpoints are interchangeable,
and that asking for FP8 where it cannot run fails before any model is built."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megatrain.config import ConfigError, load_config
from megatrain.model.gpt import GPT
from megatrain.parallel.init import DistEnv
from megatrain.precision import apply_precision, check_precision_supported, fp8_linears, fp8_plan

REPO = Path(__file__).resolve().parents[3]
SMALL = ["model.vocab_size=256", "model.n_layer=3", "model.n_head=2", "model.d_model=64", "model.seq_len=32",
         "model.attention=full", "model.kernels.attention=reference"]


LLAMA = REPO / "configs" / "llama-tiny-cpu.yaml"  # RoPE, RMSNorm, SwiGLU, grouped-query attention


def _config(*overrides: str, recipe: Path | None = None):
    shape = SMALL if recipe is None else ["model.n_layer=3", "model.seq_len=32"]
    return load_config(recipe, [*shape, "train.precision=fp8", "train.fp8.emulate=true", *overrides])


def _float8_linear() -> type:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


@pytest.mark.parametrize("family", ["gpt-parallel", "gpt-serial", "llama"])
def test_block_linears_convert_embeddings_and_head_stay(family):
    if family == "llama":
        cfg = _config("model.tie_embeddings=false", recipe=LLAMA)
    else:
        cfg = _config(f"model.block={family.split('-')[1]}", "model.tie_embeddings=false")
    model = apply_precision(GPT(cfg.model), cfg)
    converted = {fqn for fqn, _ in fp8_linears(model)}
    expected = {f"blocks.{i}.{name}" for i in range(3) for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert converted == expected
    float8_linear = _float8_linear()
    for fqn, module in model.named_modules():  # embeddings, norms and the head are untouched
        if not fqn.startswith("blocks."):
            assert not isinstance(module, float8_linear), fqn
    assert type(model.embed.wte) is nn.Embedding and isinstance(model.head.weight, nn.Parameter)


def test_first_and_last_block_can_stay_in_high_precision():
    cfg = _config("train.fp8.keep_first_block=true", "train.fp8.keep_last_block=true")
    model = GPT(cfg.model)
    plan = fp8_plan(model, cfg)
    apply_precision(model, cfg)
    assert {fqn.split(".")[1] for fqn, _ in fp8_linears(model)} == {"1"}
    assert plan["blocks.0.mlp.fc"] == "kept: first block (train.fp8.keep_first_block)"
    assert plan["blocks.2.attn.qkv"] == "kept: last block (train.fp8.keep_last_block)"
    assert type(model.blocks[0].mlp.fc) is nn.Linear and type(model.blocks[2].attn.proj) is nn.Linear


def test_linears_scaled_mm_cannot_take_stay_with_the_reason():
    cfg = _config("model.d_model=72", "model.n_head=2", "model.d_ff=144")  # 72 is not a multiple of 16
    model = GPT(cfg.model)
    plan = fp8_plan(model, cfg)
    assert plan["blocks.0.attn.qkv"] == "kept: 72x216 is not a multiple of 16 (_scaled_mm)"
    assert fp8_linears(apply_precision(model, cfg)) == []


MOE = REPO / "configs" / "moe-tiny-cpu.yaml"  # routed SwiGLU experts on the Llama parts


def test_moe_experts_run_fp8_grouped_gemms_the_router_stays_and_the_function_is_kept():
    """Every block's expert bank takes the FP8 grouped GEMMs (emulated here), its router's gate
    stays in high precision; the FP8 model computes the high-precision one's loss within 1% and
    its gradients point the same way."""
    cfg = _config("train.fp8.experts=true", recipe=MOE)
    torch.manual_seed(0)
    reference = GPT(cfg.model)
    model = GPT(cfg.model)
    model.load_state_dict(reference.state_dict())
    plan = fp8_plan(model, cfg)
    apply_precision(model, cfg)
    experts = {fqn: m for fqn, m in model.named_modules() if type(m).__name__ == "Experts"}
    assert experts and all(m.fp8 == "emulate" and plan[fqn] == "fp8" for fqn, m in experts.items())
    gates = [fqn for fqn in plan if fqn.endswith("router.gate")]
    assert gates and all(plan[g] == "kept: MoE router (its scores choose the experts)" for g in gates)
    assert all(type(model.get_submodule(g)) is nn.Linear for g in gates)
    idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))
    targets = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))
    loss, ref_loss = model(idx, targets), reference(idx, targets)
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0) > 0.98
    bank = next(iter(experts.values()))  # the experts themselves take the FP8 path
    rows, counts = torch.randn(10, cfg.model.d_model), torch.zeros(bank.fc.shape[0], dtype=torch.long)
    counts[0], counts[2] = 4, 6
    with torch.no_grad():
        in_fp8 = bank(rows, counts)
        bank.fp8 = None
        in_high = bank(rows, counts)
    assert not torch.equal(in_fp8, in_high)
    assert torch.allclose(in_fp8, in_high, rtol=0.1, atol=0.1 * in_high.abs().max().item())


def test_an_expert_bank_the_fp8_gemm_cannot_take_stays_with_the_reason():
    off = _config(recipe=MOE)  # by default the experts stay bf16 (measured slower in FP8 at this width)
    assert fp8_plan(GPT(off.model), off)["blocks.1.mlp.experts"] == "kept: MoE experts (train.fp8.experts is off)"
    cfg = _config("model.moe.expert_d_ff=40", "train.fp8.experts=true", recipe=MOE)  # 40 is not a multiple of 16
    model = apply_precision(GPT(cfg.model), cfg)
    plan = fp8_plan(model, cfg)
    assert plan["blocks.1.mlp.experts"] == "kept: 128x40x80 is not a multiple of 16 (_scaled_grouped_mm)"
    assert all(m.fp8 is None for m in model.modules() if type(m).__name__ == "Experts")


def test_fp8_experts_with_expert_parallelism_are_refused_naming_both_fields():
    with pytest.raises(ConfigError, match="parallel.ep=2 with train.precision=fp8"):
        load_config(MOE, ["train.precision=fp8", "parallel.ep=2", "parallel.zero_stage=0"])


def test_bf16_precision_converts_nothing():
    cfg = load_config(None, SMALL)
    model = apply_precision(GPT(cfg.model), cfg)
    assert fp8_linears(model) == []


@contextlib.contextmanager
def count_fp8_matmuls(model):
    """How often each converted linear's weight goes through torchao's FP8 matmul."""
    from torchao.float8 import float8_linear

    names = {m.weight.data_ptr(): fqn for fqn, m in fp8_linears(model)}
    function = float8_linear.matmul_with_hp_or_float8_args  # an autograd.Function: apply is inherited
    assert "apply" not in vars(function)
    calls, real = {}, function.apply

    def counting(x, weight_t, *rest):
        fqn = names[weight_t.data_ptr()]
        calls[fqn] = calls.get(fqn, 0) + 1
        return real(x, weight_t, *rest)

    function.apply = counting
    try:
        yield calls
    finally:
        del function.apply


@pytest.mark.parametrize("family", ["gpt-parallel", "gpt-serial", "llama"])
def test_every_converted_linear_runs_and_the_model_keeps_its_function(family):
    """The GeLU MLP's forward reads fc.weight directly (bias into the GeLU kernel): precision must
    route it through the converted fc, or the biggest GEMM would silently stay in high precision.
    Llama: SwiGLU's fc holds gate and up (one FP8 GEMM), grouped-query qkv, RoPE between."""
    cfg = _config(recipe=LLAMA) if family == "llama" else _config(f"model.block={family.split('-')[1]}")
    torch.manual_seed(0)
    reference = GPT(cfg.model)
    model = GPT(cfg.model)
    model.load_state_dict(reference.state_dict())
    apply_precision(model, cfg)
    idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))
    targets = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len))
    with count_fp8_matmuls(model) as calls:
        loss = model(idx, targets)
    assert calls == {fqn: 1 for fqn, _ in fp8_linears(model)} and len(calls) == 12
    loss.backward()
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    # e4m3 keeps 3 mantissa bits: the loss moves by far less than 1%, the gradients stay aligned
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0) > 0.98
    assert not torch.equal(grads, ref_grads)  # the casts did happen


def test_fp8_and_bf16_checkpoints_are_interchangeable():
    """Float8Linear keeps exactly nn.Linear's parameters and no scale state (dynamic scaling)."""
    cfg = _config()
    plain = GPT(cfg.model)
    fp8 = apply_precision(GPT(cfg.model), cfg)
    assert list(fp8.state_dict()) == list(plain.state_dict())
    assert all(not list(m.buffers()) for _, m in fp8_linears(fp8))
    fp8.load_state_dict(plain.state_dict())
    restored = GPT(cfg.model)
    restored.load_state_dict(fp8.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name


def test_fp8_without_an_fp8_gpu_fails_with_the_reason():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"train.precision=fp8: this run's device is cpu, .*compute capability >= 8.9"):
        check_precision_supported(load_config(None, ["train.precision=fp8"]), cpu)
    check_precision_supported(load_config(None, ["train.precision=fp8", "train.fp8.emulate=true"]), cpu)
    check_precision_supported(load_config(None, []), cpu)


def test_trainer_refuses_fp8_before_building_anything(monkeypatch):
    """The check is the trainer's first act: no data is sharded and no model is built."""
    import megatrain.training.trainer as trainer_module

    built = []
    monkeypatch.setattr(trainer_module, "build_parallel_model", lambda *a, **k: built.append("model"))
    monkeypatch.setattr(trainer_module, "prepare_data", lambda *a, **k: built.append("data"))
    monkeypatch.setattr(trainer_module, "build_process_groups", lambda *a, **k: built.append("groups"))
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ConfigError, match="FP8 GEMMs need an NVIDIA GPU"):
        trainer_module.Trainer(load_config(None, ["train.precision=fp8"]), env)
    assert built == []
