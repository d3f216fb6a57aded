"""The first norm of a serial block with its skip connection (kernels/rmsnorm.rms_norm_with_skip):
the Triton Function against the reference, forward and both gradients (the skip's gradient added
in the norm's backward), on a GPU and in Triton's interpreter; the block with the flag against the
block without it on CPU."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.kernels.rmsnorm import rms_norm_with_skip

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _grads(impl: str, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, skip = rms_norm_with_skip(x, w, 1e-5, impl)
    # both outputs used, as in the block: the norm by attention, the skip by the residual add
    loss = (y.float() * a).sum() + (skip.float().square() * b).sum()
    loss.backward()
    return y.detach(), skip.detach(), x.grad, w.grad


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _compare(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    rows, d = 37, 96  # rows not a multiple of the backward's programs
    x = torch.randn(2, rows, d, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    a, b = torch.randn(2, rows, d, generator=g).to(device), torch.randn(2, rows, d, generator=g).to(device)
    got, want = _grads("fused", x, w, a, b), _grads("reference", x, w, a, b)
    exact = _grads("reference", x.double(), w.double(), a.double(), b.double())
    for name, u, v, e in zip(("y", "skip", "dx", "dweight"), got, want, exact):
        assert u.dtype == v.dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5, msg=name)
        else:  # bf16: no worse than twice the reference's own error (its dweight sums in bf16)
            err, ref_err = _rel_err(u, e), _rel_err(v, e)
            assert err <= 2 * ref_err + 1e-3, f"{name}: error {err:.2e}, the reference's {ref_err:.2e}"
    assert torch.equal(got[1], x)  # the skip is x itself


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_reference(dtype):
    _compare("cuda", dtype)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("per_sm, rows_at_once", [(8, 4), (1, 4), (1, 1), (2, 8)])
def test_fused_in_the_triton_interpreter(monkeypatch, per_sm, rows_at_once):
    # the interpreter counts 4 SMs: 74 rows make programs of 3, 19, 19 and 10 rows, so tiles of
    # rows run past a program's rows and past the last row
    from megatrain.kernels import rmsnorm_triton

    monkeypatch.setattr(rmsnorm_triton, "BWD_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(rmsnorm_triton, "BWD_ROWS_AT_ONCE", rows_at_once)
    _compare("cpu", torch.float32)


def test_the_serial_block_is_the_same_with_the_norm_carrying_the_skip(monkeypatch):
    import megatrain.model.block as block_module
    from megatrain.config.model import ModelConfig
    from megatrain.model.gpt import GPT

    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, seq_len=16, norm="rmsnorm", mlp="moe",
                      position="rope", bias=False, block="serial", moe={"n_experts": 4, "top_k": 2, "expert_d_ff": 16})
    torch.manual_seed(0)
    block = GPT(cfg).blocks[0]  # initialised as the model initialises it (the experts' banks start empty)
    assert isinstance(block, block_module.SerialBlock)
    x = torch.randn(2, 16, 32)
    outs = []
    for carries in (False, True):
        monkeypatch.setattr(block_module, "NORM1_CARRIES_SKIP", carries)
        xi = x.clone().requires_grad_()
        block.zero_grad()
        calls = []
        handle = block.ln1.register_forward_hook(lambda *_: calls.append(1))  # the plain call
        out = block(xi)
        handle.remove()
        assert bool(calls) != carries  # the flag takes the norm's other path
        out.square().sum().backward()
        outs.append((out.detach(), xi.grad, block.ln1.weight.grad.clone()))
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
