"""``train.fp8.casts`` on CPU (torchao's emulation): casting each activation once computes exactly
what torchao's per-linear casts compute, with fewer casts; recipes that cannot share a cast keep
torchao's; ``fused`` falls back to the reference off CUDA."""

import contextlib
from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.model.gpt import GPT
from megatrain.precision import apply_precision

REPO = Path(__file__).resolve().parents[3]
LLAMA = REPO / "configs" / "llama-tiny-cpu.yaml"
SMALL = ["model.vocab_size=256", "model.n_layer=3", "model.n_head=2", "model.d_model=64", "model.seq_len=32",
         "model.attention=full", "model.kernels.attention=reference"]


def _config(family: str, *overrides: str):
    if family == "llama":
        return load_config(LLAMA, ["model.n_layer=3", "model.seq_len=32", "train.precision=fp8",
                                   "train.fp8.emulate=true", *overrides])
    return load_config(None, [*SMALL, f"model.block={family.split('-')[1]}", "train.precision=fp8",
                              "train.fp8.emulate=true", *overrides])


@contextlib.contextmanager
def count_input_casts():
    """Casts of activations (GemmInputRole.INPUT) to FP8, torchao's inside its matmul and megatrain's."""
    from torchao.float8 import float8_linear
    from torchao.float8.float8_training_tensor import GemmInputRole

    from megatrain.kernels import fp8_ops

    counts = {"n": 0}
    real = float8_linear.hp_tensor_to_float8_dynamic

    def counting(*args, **kwargs):
        counts["n"] += kwargs.get("gemm_input_role") is GemmInputRole.INPUT
        return real(*args, **kwargs)

    float8_linear.hp_tensor_to_float8_dynamic = fp8_ops.hp_tensor_to_float8_dynamic = counting
    try:
        yield counts
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = fp8_ops.hp_tensor_to_float8_dynamic = real


def _loss_and_grads(cfg, state, idx, targets):
    model = GPT(cfg.model)
    model.load_state_dict(state)
    apply_precision(model, cfg)
    with count_input_casts() as casts:
        loss = model(idx, targets)
        loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}, casts["n"]


@pytest.mark.parametrize("family", ["gpt-parallel", "gpt-serial", "llama"])
@pytest.mark.parametrize("casts", ["once", "fused"])
def test_casting_once_computes_what_torchao_computes_with_fewer_casts(family, casts):
    torchao_cfg = _config(family, "train.fp8.casts=torchao")
    torch.manual_seed(0)
    state = GPT(torchao_cfg.model).state_dict()
    idx = torch.randint(0, torchao_cfg.model.vocab_size, (2, 32))
    targets = torch.randint(0, torchao_cfg.model.vocab_size, (2, 32))
    ref_loss, ref_grads, ref_casts = _loss_and_grads(torchao_cfg, state, idx, targets)
    loss, grads, n_casts = _loss_and_grads(_config(family, f"train.fp8.casts={casts}"), state, idx, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # torchao: each of a block's 4 linears casts its input in the forward and again in the backward
    assert ref_casts == 3 * 4 * 2
    # once: qkv and fc share the parallel block's normalised input; nothing is cast in the backward
    assert n_casts == 3 * (3 if family == "gpt-parallel" else 4)


def test_rowwise_keeps_torchaos_casts():
    """Rowwise scales the input per row for the output GEMM and per column for the weight
    gradient: one FP8 copy cannot serve both, so the linears keep torchao's forward."""
    from torchao.float8.float8_linear import Float8Linear

    cfg = _config("gpt-parallel", "train.fp8.recipe=rowwise", "train.fp8.casts=once")
    model = apply_precision(GPT(cfg.model), cfg)
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, Float8Linear))
    assert "forward" not in vars(model.blocks[0])


def test_kept_blocks_stay_plain():
    cfg = _config("gpt-parallel", "train.fp8.keep_first_block=true", "train.fp8.casts=once")
    model = apply_precision(GPT(cfg.model), cfg)
    assert "forward" not in vars(model.blocks[0]) and "forward" in vars(model.blocks[1])


def test_casts_is_validated():
    with pytest.raises(Exception, match="train.fp8.casts"):
        _config("gpt-parallel", "train.fp8.casts=sometimes")


@pytest.mark.parametrize("casts", ["once", "fused"])
@pytest.mark.slow
def test_compiled_blocks_keep_the_cast_inside_one_graph(casts):
    """fullgraph: no graph break between a cast and its GEMMs (an FP8 tensor crossing graphs
    would need a subclass gradient, which AOTAutograd refuses), and the compiled blocks compute
    what the eager ones do."""
    cfg = _config("gpt-parallel", f"train.fp8.casts={casts}")
    torch.manual_seed(0)
    state = GPT(cfg.model).state_dict()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
    eager_loss, eager_grads, _ = _loss_and_grads(cfg, state, idx, idx)
    model = GPT(cfg.model)
    model.load_state_dict(state)
    apply_precision(model, cfg)
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    loss = model(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
