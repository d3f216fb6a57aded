"""kernels/fp8_grouped.py: the FP8 operands (power-of-two scales, e4m3 range, the layouts
``torch._scaled_grouped_mm`` takes), the plain reference, the emulation the CPU engine uses, and on a
Hopper GPU the fast grouped GEMM held to the reference, forward and backward."""

import pytest
import torch

from megatrain.kernels.fp8_grouped import (
    E4M3_MAX,
    dequantize,
    grouped_mm_emulated,
    grouped_mm_fp8,
    grouped_mm_fp8_reference,
    quantize_columns,
    quantize_rows,
)


def _operands(m_counts=(5, 0, 17, 10), k=32, n=48, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(m_counts)
    a = (torch.randn(int(counts.sum()), k, generator=g) * 3).to(dtype).to(device)
    b = (torch.randn(len(m_counts), k, n, generator=g) * 0.05).to(dtype).to(device)
    return a, b, counts.to(device)


def _is_power_of_two(x: torch.Tensor) -> bool:
    return bool(torch.all(torch.exp2(torch.round(torch.log2(x))) == x))


def test_row_quantization_uses_power_of_two_scales_within_e4m3():
    a, _, _ = _operands()
    a[3] = 0.0  # an all-zero row stays zero
    q, scale = quantize_rows(a)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and scale.shape == (a.shape[0],)
    assert _is_power_of_two(scale)
    assert q.float().abs().max() <= E4M3_MAX
    # the largest element of each row lands in [224, 448]: the scale uses the range
    row_max = q.float().abs().amax(-1)
    assert torch.all((row_max[a.abs().amax(-1) > 0] >= E4M3_MAX / 2))
    back = dequantize(q, scale, -1)
    assert torch.equal(back[3], torch.zeros_like(back[3]))
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of itself (or of the row's tiny values)
    err = (back - a).abs()
    assert torch.all(err <= a.abs() / 16 + a.abs().amax(-1, keepdim=True) * 2.0**-9)


def test_column_quantization_is_column_major_with_one_scale_per_expert_and_column():
    _, b, _ = _operands()
    q, scale = quantize_columns(b)
    assert q.shape == b.shape and scale.shape == (b.shape[0], b.shape[2])
    assert q.stride(-2) == 1 and q.stride(-1) == b.shape[1]  # [E, K, N] column-major, as the GEMM takes B
    assert _is_power_of_two(scale)
    col_max = q.float().abs().amax(1)
    assert torch.all(col_max >= E4M3_MAX / 2) and torch.all(col_max <= E4M3_MAX)
    err = (dequantize(q, scale, 1) - b).abs()
    assert torch.all(err <= b.abs() / 16 + b.abs().amax(1, keepdim=True) * 2.0**-9)


def test_reference_is_the_per_expert_product_of_the_dequantized_operands_and_near_the_exact_one():
    a, b, counts = _operands()
    out = grouped_mm_fp8_reference(a, b, counts, out_dtype=torch.float32)
    qa, sa = quantize_rows(a)
    qb, sb = quantize_columns(b)
    a32, b32 = dequantize(qa, sa, -1), dequantize(qb, sb, 1)
    start = 0
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(out[start:start + n], a32[start:start + n] @ b32[e])
        exact = a[start:start + n] @ b[e]
        if n:
            assert torch.allclose(out[start:start + n], exact, rtol=0.1, atol=0.1 * exact.abs().max().item())
        start += n


def test_emulation_computes_the_reference_forward_and_passes_gradients_straight_through():
    a, b, counts = _operands()
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_mm_emulated(a, b, offsets)
    assert torch.equal(out, grouped_mm_fp8_reference(a.detach(), b.detach(), counts, out_dtype=torch.float32))
    grad = torch.randn_like(out)
    out.backward(grad)
    # straight through the casts: the gradients of the product of the dequantized operands
    qa, sa = quantize_rows(a.detach())
    qb, sb = quantize_columns(b.detach())
    a32, b32 = dequantize(qa, sa, -1), dequantize(qb, sb, 1)
    start, want_a, want_b = 0, torch.zeros_like(a), torch.zeros_like(b)
    for e, n in enumerate(counts.tolist()):
        want_a[start:start + n] = grad[start:start + n] @ b32[e].T
        want_b[e] = a32[start:start + n].T @ grad[start:start + n]
        start += n
    assert torch.allclose(a.grad, want_a, atol=1e-5) and torch.allclose(b.grad, want_b, atol=1e-5)


def test_shapes_the_fp8_gemm_cannot_take_are_refused_naming_them():
    a, b, counts = _operands(k=24)
    with pytest.raises(ValueError, match="K=24"):
        grouped_mm_fp8(a, b, torch.cumsum(counts, 0).to(torch.int32), emulate=True)


needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9 or not hasattr(torch, "_scaled_grouped_mm"),
    reason="needs a Hopper GPU (torch._scaled_grouped_mm)")


@pytest.mark.gpu
@needs_fp8_gpu
def test_fast_fp8_grouped_gemm_matches_the_reference_forward_and_backward():
    """Forward: the reference's product of the same e4m3 operands (fp32 accumulation, bf16 out).
    Input gradient: the gradient cast to e4m3 row-wise times B cast per row of B. Weight gradient:
    the bf16 grouped GEMM of the unquantized operands, exactly."""
    a, b, counts = _operands(m_counts=(64, 0, 300, 17, 131), k=256, n=384, dtype=torch.bfloat16, device="cuda")
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    a.requires_grad_(True)
    w = b.transpose(-2, -1).contiguous().requires_grad_(True)  # stored as the experts store it: [E, N, K]
    out = grouped_mm_fp8(a, w.transpose(-2, -1), offsets)
    want = grouped_mm_fp8_reference(a.detach(), b, counts, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    grad = torch.randn_like(out)
    out.backward(grad)
    qg, sg = quantize_rows(grad)
    qbt, sbt = quantize_columns(b.transpose(-2, -1))
    g32, bt32 = dequantize(qg, sg, -1), dequantize(qbt, sbt, 1)
    start = 0
    for e, n in enumerate(counts.tolist()):
        want_a = g32[start:start + n] @ bt32[e]
        if n:
            assert torch.allclose(a.grad[start:start + n].float(), want_a, rtol=2e-2,
                                  atol=2e-2 * want_a.abs().max().item())
        start += n
    want_w = torch._grouped_mm(a.detach().transpose(-2, -1), grad, offs=offsets).transpose(-2, -1)
    assert torch.equal(w.grad, want_w)
