"""FP8 grouped GEMMs for the MoE experts (``train.precision: fp8`` with ``model.mlp: moe``).

The experts' two projections are grouped GEMMs over row segments, one segment per expert
(``model/moe_experts.py``). In FP8 each one runs as

    forward  out = A @ B_e          A [M, K] row-wise FP8, B [E, K, N] per (expert, column) FP8
    dgrad    dA  = dOut @ B_e^T     dOut row-wise FP8, B per (expert, row of B) FP8
    wgrad    dB_e = A_e^T dOut_e    bf16 (K-grouped: the segments split the reduction)

on ``torch._scaled_grouped_mm`` (Hopper), with fp32 accumulation of the products and e4m3 for
every operand. The weight gradient stays bf16: an FP8 K-grouped GEMM needs every expert's row
count to be a multiple of 16, and a dropless router gives any count. Scales are powers of two
(``2^floor(log2(448 / amax))``), so a dequantized value is exactly the e4m3 value times a power
of two and the reference below reproduces the operands bit for bit.

``grouped_mm_fp8_reference`` is the plain version the tests hold the fast one to: the same
quantized operands, dequantized and multiplied per expert in fp32. With ``train.fp8.emulate``
(a CPU run) the experts take ``grouped_mm_emulated``: the same round trip of both operands, a
per-expert GEMM in their dtype, and a straight-through backward (as torchao's emulation does).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales that map ``amax`` to at most e4m3's largest value, rounded down to a power of
    two (an all-zero row gets 1: any scale leaves it zero)."""
    amax = amax.float()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-30))))
    return torch.where(amax > 0, scale, torch.ones_like(scale)).clamp(max=2.0**100)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K] row-major, scale [M]) with x ~= q / scale[:, None]."""
    scale = _pow2_scale(x.abs().amax(-1))
    q = (x.float() * scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), scale


def quantize_columns(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b [E, K, N] (any layout) -> (e4m3 [E, K, N] column-major, scale [E, N]): one scale per
    expert and output column, taken over the reduction dimension K."""
    scale = _pow2_scale(b.abs().amax(1))  # [E, N]
    rows_of_t = b.transpose(-2, -1).float() * scale[:, :, None]  # [E, N, K]: K contiguous once written
    q = rows_of_t.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous().transpose(-2, -1)  # [E, K, N] col-major
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """The fp32 values ``q`` stands for; ``scale`` broadcast along ``dim`` (the reduced one)."""
    return q.float() / scale.unsqueeze(dim)


def grouped_mm_fp8_reference(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor,
                             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a [M, K] rows grouped by expert (``counts`` [E]), b [E, K, N] -> [M, N]: the forward of
    ``grouped_mm_fp8`` on the same quantized operands, dequantized, per expert in fp32."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_columns(b)
    a32, b32 = dequantize(qa, sa, -1), dequantize(qb, sb, 1)
    out = a32.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, n in enumerate(counts.tolist()):  # a host sync per call: the reference, not the fast path
        out[start:start + n] = a32[start:start + n] @ b32[e]
        start += n
    return out.to(out_dtype)


class _QuantDequant(torch.autograd.Function):
    """Emulation's operand: forward the FP8 round trip, backward the identity (a straight-through
    cast, as torchao's emulated float8 linears do)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: bool) -> torch.Tensor:
        if rows:
            q, s = quantize_rows(x)
            return dequantize(q, s, -1).to(x.dtype)
        q, s = quantize_columns(x)
        return dequantize(q, s, 1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def grouped_mm_emulated(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``train.fp8.emulate``: the FP8 round trip of both operands, then a grouped GEMM in the
    operands' dtype on any device (per expert; ``offsets`` [E] are the segments' ends)."""
    a, b = _QuantDequant.apply(a, True), _QuantDequant.apply(b, False)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, ends))]
                     + [a.new_zeros(a.shape[0] - ends[-1], b.shape[-1])])


class GroupedMMFP8(torch.autograd.Function):
    """``out = a @ b[e]`` per row segment, forward and input gradient in FP8 (see the module doc)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # a [M, K] bf16, b [E, K, N] (a transposed weight view), offsets [E] int32 segment ends
        qa, sa = quantize_rows(a)
        qb, sb = quantize_columns(b)
        ctx.save_for_backward(a, b, offsets)
        return torch._scaled_grouped_mm(qa, qb, sa.reciprocal(), sb.reciprocal(), offsets,
                                        out_dtype=a.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        qg, sg = quantize_rows(grad)  # [M, N]
        qbt, sbt = quantize_columns(b.transpose(-2, -1))  # [E, N, K]: B^T's columns are B's rows
        grad_a = torch._scaled_grouped_mm(qg, qbt, sg.reciprocal(), sbt.reciprocal(), offsets,
                                          out_dtype=a.dtype, use_fast_accum=True)
        grad_b = torch._grouped_mm(a.transpose(-2, -1), grad, offs=offsets)  # [E, K, N] in bf16
        return grad_a, grad_b, None


def grouped_mm_fp8(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """a [M, K] grouped by expert, b [E, K, N], offsets [E] (int32 ends) -> [M, N] in a's dtype.
    K and N must be multiples of 16 (the FP8 GEMM's alignment)."""
    if a.shape[-1] % 16 or b.shape[-1] % 16:
        raise ValueError(f"FP8 grouped GEMM needs K and N multiples of 16, got K={a.shape[-1]}, N={b.shape[-1]}")
    if emulate:
        return grouped_mm_emulated(a, b, offsets)
    return GroupedMMFP8.apply(a, b, offsets)
