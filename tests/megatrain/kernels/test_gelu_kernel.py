"""Bias + GeLU (tanh): reference on CPU; fused Triton vs reference, forward and backward, on GPU.

Tolerances (relative Frobenius error against float64 of the same inputs): fp32 below 1e-5;
bf16 within 2x (+1e-4) of torch's own bf16 ``F.gelu(x + b)``.
"""

import pytest
import torch
import torch.nn.functional as F

from megatrain.kernels.gelu import bias_gelu, bias_gelu_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def test_reference_is_tanh_gelu_of_x_plus_bias():
    x, b = torch.randn(4, 6, 32), torch.randn(32)
    torch.testing.assert_close(bias_gelu(x, b, "reference"), F.gelu(x + b, approximate="tanh"))
    torch.testing.assert_close(bias_gelu(x, None, "reference"), F.gelu(x, approximate="tanh"))


def _run(fn, x, b, dy):
    y = fn(x, b)
    leaves = [x] + ([b] if b is not None else [])
    return [y, *torch.autograd.grad(y, leaves, dy)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(2, 128, 8192), (3, 37, 3072), (1000, 1000), (129, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_matches_reference(shape, dtype, bias):
    g = torch.Generator("cuda").manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=g, device="cuda")).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=g, device="cuda").to(dtype).requires_grad_() if bias else None
    dy = torch.randn(shape, generator=g, device="cuda").to(dtype)
    fused = _run(lambda x, b: bias_gelu(x, b, "fused"), x, b, dy)
    ref = _run(bias_gelu_reference, x, b, dy)
    x64 = x.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    exact = _run(bias_gelu_reference, x64, b64, dy.double())
    for name, got, r, want in zip(["y", "dx", "db"], fused, ref, exact):
        assert got.dtype == r.dtype and got.shape == r.shape and torch.isfinite(got).all(), name
        err, ref_err = rel_err(got, want), rel_err(r, want)
        limit = 1e-5 if dtype == torch.float32 else 2 * ref_err + 1e-4
        assert err <= limit, f"{name}: fused error {err:.2e} > {limit:.2e} (torch's own: {ref_err:.2e})"


@pytest.mark.gpu
@requires_cuda
def test_fused_with_fp32_bias_keeps_bf16_activations():
    """Under autocast the fc output is bf16 and the bias fp32: fused stays bf16 (the unfused add
    would promote to fp32), and dbias comes back fp32."""
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4096, device="cuda", requires_grad=True)
    y = bias_gelu(x, b, "fused")
    assert y.dtype == torch.bfloat16
    y_ref = bias_gelu_reference(x, b)
    assert rel_err(y, y_ref) < 1e-2
    dy = torch.randn_like(y)
    dx, db = torch.autograd.grad(y, [x, b], dy)
    dx_ref, db_ref = torch.autograd.grad(y_ref, [x, b], dy.float())
    assert dx.dtype == torch.bfloat16 and db.dtype == torch.float32
    assert rel_err(dx, dx_ref) < 1e-2 and rel_err(db, db_ref) < 1e-2
