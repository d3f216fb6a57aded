"""LayerNorm: dispatch on CPU; fused Triton vs reference, forward and backward, on GPU.

Tolerances (relative Frobenius error against a float64 reference of the same inputs):
fp32: below 1e-5. bf16: within 2x (+1e-4) of what torch's own bf16 LayerNorm gets, since
both round the same fp32 math to bf16 once. Mixed dtypes (bf16 activations, fp32 weights) are
checked under autocast, against the reference's fp32 result, within 1e-2.
"""

import pytest
import torch
import torch.nn.functional as F

from megatrain.kernels import resolve
from megatrain.kernels.layernorm import layer_norm, layer_norm_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def test_auto_is_reference_on_cpu():
    assert resolve("auto", torch.zeros(1)) == "reference"


def test_reference_is_torch_layer_norm():
    x, w, b = torch.randn(3, 5, 16), torch.randn(16), torch.randn(16)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5, "reference"), F.layer_norm(x, (16,), w, b, 1e-5))


def _inputs(shape, dtype, param_dtype, bias, device="cuda"):
    g = torch.Generator(device).manual_seed(sum(shape) + 7 * bias)
    n = shape[-1]
    x = (torch.randn(shape, generator=g, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(n, generator=g, device=device)).to(param_dtype).requires_grad_()
    b = (0.2 * torch.randn(n, generator=g, device=device)).to(param_dtype).requires_grad_() if bias else None
    dy = torch.randn(shape, generator=g, device=device).to(dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    y = fn(x, w, b)
    leaves = [x, w] + ([b] if b is not None else [])
    return [y, *torch.autograd.grad(y, leaves, dy)]


SHAPES = [(4, 128, 768), (2, 100, 2048), (3, 1000), (5, 4096)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, param_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_matches_reference(shape, dtype, param_dtype, bias):
    x, w, b, dy = _inputs(shape, dtype, param_dtype, bias)
    fused = _run(lambda x, w, b: layer_norm(x, w, b, 1e-5, "fused"), x, w, b, dy)
    torch_out = _run(lambda x, w, b: layer_norm_reference(x, w, b, 1e-5), x, w, b, dy)
    exact = _run(lambda x, w, b: F.layer_norm(x, (shape[-1],), w, b, 1e-5),
                 *[t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)], dy.double())
    names = ["y", "dx", "dw", "db"]
    for name, got, ref, want in zip(names, fused, torch_out, exact):
        assert got.dtype == ref.dtype and torch.isfinite(got).all(), name
        err, ref_err = rel_err(got, want), rel_err(ref, want)
        limit = 1e-5 if dtype == torch.float32 else 2 * ref_err + 1e-4
        assert err <= limit, f"{name}: fused error {err:.2e} > {limit:.2e} (torch's own: {ref_err:.2e})"


@pytest.mark.gpu
@requires_cuda
def test_fused_under_autocast_writes_bf16_and_matches():
    x, w, b, dy = _inputs((8, 256, 1024), torch.float32, torch.float32, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer_norm(x, w, b, 1e-5, "fused")
        y_ref = layer_norm_reference(x, w, b, 1e-5)
    assert y.dtype == torch.bfloat16  # the reference gives fp32 here; the next linear casts anyway
    assert rel_err(y, y_ref) < 1e-2
    dx, dw = torch.autograd.grad(y, [x, w], dy.to(y.dtype))
    dx_ref, dw_ref = torch.autograd.grad(y_ref, [x, w], dy.to(y.dtype).float())
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    assert rel_err(dx, dx_ref) < 1e-2 and rel_err(dw, dw_ref) < 1e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_layer_norm_matches_unfused(dtype):
    from megatrain.kernels.layernorm import add_layer_norm

    x, w, b, dy = _inputs((4, 64, 2048), dtype, dtype, True)
    residual = torch.randn_like(x).requires_grad_()
    ds = torch.randn_like(x)

    def run(impl, x, residual, w, b, dy, ds):
        y, s = add_layer_norm(x, residual, w, b, 1e-5, impl)
        return [y, s, *torch.autograd.grad([y, s], [x, residual, w, b], [dy, ds])]

    fused, ref = run("fused", x, residual, w, b, dy, ds), run("reference", x, residual, w, b, dy, ds)
    exact = run("reference", *[t.detach().double().requires_grad_() for t in (x, residual, w, b)],
                dy.double(), ds.double())
    for name, got, r, want in zip(["y", "s", "dx", "dres", "dw", "db"], fused, ref, exact):
        assert got.dtype == r.dtype, name
        err, ref_err = rel_err(got, want), rel_err(r, want)
        limit = 1e-5 if dtype == torch.float32 else 2 * ref_err + 1e-4
        assert err <= limit, f"{name}: fused error {err:.2e} > {limit:.2e} (torch's own: {ref_err:.2e})"
