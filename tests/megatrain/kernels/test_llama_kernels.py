"""RMSNorm (+ residual add), SwiGLU and RoPE: the references against brute-force formulas on CPU
(RoPE against the complex-number form); the Triton kernels against the references, forward and
backward, on GPU.

GPU tolerances (norm-wise relative error against the reference run in float64 on the same
inputs): fp32 below 1e-5; bf16 within 2x (+2e-3) of the reference's own bf16 error, since both
round the same fp32 math to bf16 (the fused kernels once, the references at each op)."""

from __future__ import annotations

import cmath
import math
import os

import pytest
import torch

from megatrain.kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from megatrain.kernels.rope import rope, rope_inv_freq, rope_reference, rope_tables
from megatrain.kernels.swiglu import swiglu, swiglu_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- CPU: references vs formulas


def test_rmsnorm_reference_is_the_formula_row_by_row():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
    y = rms_norm_reference(x, w, 1e-6)
    for i in range(3):
        for j in range(7):
            row = x[i, j].tolist()
            rms = math.sqrt(sum(v * v for v in row) / len(row) + 1e-6)
            for k in range(10):
                assert y[i, j, k].item() == pytest.approx(w[k].item() * row[k] / rms, rel=1e-12, abs=1e-12)
    s = torch.randn(3, 7, 10, generator=g, dtype=torch.float64)
    normed, summed = add_rms_norm(x, s, w, 1e-6, "reference")
    torch.testing.assert_close(summed, x + s)
    torch.testing.assert_close(normed, rms_norm(x + s, w, 1e-6, "reference"))


def test_swiglu_reference_is_the_formula():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64)
    y = swiglu(h, "reference")
    for i in range(4):
        for j in range(3):
            gate, up = h[i, j].item(), h[i, 3 + j].item()
            assert y[i, j].item() == pytest.approx(gate / (1 + math.exp(-gate)) * up, rel=1e-12)
    scale = torch.rand(4, generator=g, dtype=torch.float64)
    assert torch.equal(swiglu(h, "reference", scale), y * scale[:, None])  # the row scale of the MoE experts


@pytest.mark.parametrize("offset", [0, 5])
def test_rope_reference_is_the_complex_rotation(offset):
    """Pair (x[i], x[i + hd/2]) as the complex number x[i] + j x[i + hd/2]; RoPE multiplies it by
    e^(j p theta^(-2i/hd)) at position p."""
    hd, T, theta = 8, 6, 10000.0
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, T, hd, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(rope_inv_freq(hd, theta).double(), T, offset)
    y = rope_reference(x, cos.double(), sin.double())
    for h in range(2):
        for t in range(T):
            for i in range(hd // 2):
                z = complex(x[0, h, t, i].item(), x[0, h, t, i + hd // 2].item())
                rotated = z * cmath.exp(1j * (offset + t) * theta ** (-2 * i / hd))
                assert y[0, h, t, i].item() == pytest.approx(rotated.real, abs=1e-5)
                assert y[0, h, t, i + hd // 2].item() == pytest.approx(rotated.imag, abs=1e-5)


def test_llama3_scaling_keeps_high_divides_low_and_blends_between():
    from megatrain.config.model import RopeScaling

    plain = rope_inv_freq(64, 500000.0)
    scaled = rope_inv_freq(64, 500000.0, RopeScaling(factor=32, low_freq_factor=1, high_freq_factor=4, original_max_position=8192))
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 32)
    between = ~high & ~low
    assert torch.all(scaled[between] < plain[between]) and torch.all(scaled[between] > plain[between] / 32)


def test_reference_backwards_are_exact():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rope_tables(rope_inv_freq(8, 100.0).double(), 5))
    assert torch.autograd.gradcheck(lambda x: rope_reference(x, cos, sin), (x,))
    h = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_reference, (h,))
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, w: rms_norm_reference(h, w, 1e-6), (h, w))


# ---------------------------------------------------------------- GPU: fused vs reference


def _grads(fn, inputs, dy):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    dys = dy if isinstance(dy, tuple) else (dy,)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [*outs, *torch.autograd.grad(outs, leaves, dys)]


def _compare(fused, reference, inputs, dy, dtype):
    got = _grads(fused, inputs, dy)
    ref16 = _grads(reference, inputs, dy)
    exact = _grads(reference, [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                               for t in inputs], tuple(d.double() for d in dy) if isinstance(dy, tuple) else dy.double())
    for i, (g, r, e) in enumerate(zip(got, ref16, exact)):
        err, ref_err = rel_err(g, e), rel_err(r, e)
        bound = 1e-5 if dtype == torch.float32 else 2 * ref_err + 2e-3
        assert err <= bound, f"output/gradient {i}: fused error {err:.2e} > {bound:.2e} (reference's own {ref_err:.2e})"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(4, 128, 2048), (3, 1000), (2, 100, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fused_matches_reference(shape, dtype):
    g = torch.Generator("cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g, device="cuda") * 2 + 0.3).to(dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g, device="cuda")).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g, device="cuda").to(dtype)
    _compare(lambda x, w: rms_norm(x, w, 1e-5, "fused"), lambda x, w: rms_norm_reference(x, w, 1e-5), [x, w], dy, dtype)
    r = torch.randn(shape, generator=g, device="cuda").to(dtype).requires_grad_()
    dsum = torch.randn(shape, generator=g, device="cuda").to(dtype)
    _compare(lambda x, r, w: add_rms_norm(x, r, w, 1e-5, "fused"), lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-5),
             [x, r, w], (dy, dsum), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(4, 128, 2 * 8192), (3, 1000), (7, 2 * 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_fused_matches_reference(shape, dtype):
    g = torch.Generator("cuda").manual_seed(sum(shape))
    h = (torch.randn(shape, generator=g, device="cuda") * 2).to(dtype).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g, device="cuda").to(dtype)
    _compare(lambda h: swiglu(h, "fused"), swiglu_reference, [h], dy, dtype)


def _compare_scaled_swiglu(device: str, shape, dtype) -> None:
    """With a per-row scale (the MoE experts' router weights, fp32): the output, d h and d scale."""
    g = torch.Generator().manual_seed(sum(shape))
    h = (torch.randn(shape, generator=g) * 2).to(device, dtype).requires_grad_()
    scale = torch.rand(shape[:-1], generator=g).to(device).requires_grad_()
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(device, dtype)
    _compare(lambda h, c: swiglu(h, "fused", c), swiglu_reference, [h, scale], dy, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(4, 128, 2 * 640), (3, 1000), (7, 2 * 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_fused_with_a_row_scale_matches_reference(shape, dtype):
    _compare_scaled_swiglu("cuda", shape, dtype)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", [(37, 2 * 300), (5, 3, 2 * 64)])
def test_swiglu_fused_with_a_row_scale_in_the_triton_interpreter(shape):
    _compare_scaled_swiglu("cpu", shape, torch.float32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("B, H, T, hd, offset", [(2, 32, 2048, 64, 0), (1, 8, 100, 128, 7), (3, 4, 33, 16, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_fused_matches_reference_on_strided_views(B, H, T, hd, offset, dtype):
    g = torch.Generator("cuda").manual_seed(T + hd)
    # as the model: a [B, T, H, hd] projection output seen as [B, H, T, hd]
    x = torch.randn(B, T, H, hd, generator=g, device="cuda").to(dtype).transpose(1, 2).requires_grad_()
    cos, sin = rope_tables(rope_inv_freq(hd, 500000.0, device=torch.device("cuda")), T, offset)
    dy = torch.randn(B, H, T, hd, generator=g, device="cuda").to(dtype)
    _compare(lambda x: rope(x, cos, sin, "fused"), lambda x: rope_reference(x, cos.double() if x.dtype == torch.float64 else cos,
                                                                              sin.double() if x.dtype == torch.float64 else sin),
             [x], dy, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_llama_model_with_fused_kernels_matches_reference_kernels(block):
    from megatrain.config.model import KernelConfig, ModelConfig
    from megatrain.model import GPT

    base = dict(vocab_size=512, n_layer=2, n_head=8, n_kv_head=2, d_model=256, seq_len=128, position="rope",
                norm="rmsnorm", mlp="swiglu", bias=False, block=block)
    kernels = {"reference": KernelConfig(rmsnorm="reference", swiglu="reference", rope="reference"),
               "fused": KernelConfig(rmsnorm="fused", swiglu="fused", rope="fused")}
    idx = torch.randint(0, 512, (2, 128), device="cuda")
    losses, grads = {}, {}
    for name, k in kernels.items():
        torch.manual_seed(0)
        model = GPT(ModelConfig(**base, kernels=k)).cuda()
        loss = model(idx, idx)
        loss.backward()
        losses[name], grads[name] = loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])
    assert losses["fused"] == pytest.approx(losses["reference"], rel=1e-5)
    assert rel_err(grads["fused"], grads["reference"]) < 1e-4
