"""Fused SwiGLU (silu(gate) * up) in Triton, forward and backward.

h = [gate | up] is one [M, 2F] tensor (the output of the fused gate/up matmul). Both kernels walk
2D tiles [rows, cols] of the [M, F] output; the backward writes d[gate | up] into one [M, 2F]
buffer, which is the matmul's output gradient as it is (no concatenation). It saves only h.

    y = g s u,  s = sigmoid(g);   dg = dy u s (1 + g (1 - s)),  du = dy g s

Measured on an H200 at [16384, 2 x 8192] bf16 (benchmarks/kernels.py, CUDA graph): forward +
backward 0.529 ms, 96% of the copy rate, against 1.98 ms for the reference under torch.compile.

This module imports Triton at the top: ``megatrain.kernels.swiglu`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 16, 256


@triton.jit
def _swiglu_fwd_kernel(H, Y, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    gate_offs = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g = tl.load(H + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows.to(tl.int64)[:, None] * F + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(H, DY, DH, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    gate_offs = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g = tl.load(H + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows.to(tl.int64)[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(DH + gate_offs, dg.to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + gate_offs + F, du.to(DH.dtype.element_ty), mask=mask)


def _grid(M: int, F: int) -> tuple[int, int]:
    return triton.cdiv(M, BLOCK_M), triton.cdiv(F, BLOCK_N)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        h2d = h.reshape(-1, h.shape[-1]).contiguous()
        M, F = h2d.shape[0], h2d.shape[1] // 2
        y = torch.empty((M, F), dtype=h.dtype, device=h.device)
        _swiglu_fwd_kernel[_grid(M, F)](h2d, y, M, F, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
        ctx.save_for_backward(h2d)
        return y.view(*h.shape[:-1], F)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h2d,) = ctx.saved_tensors
        M, F = h2d.shape[0], h2d.shape[1] // 2
        dh = torch.empty_like(h2d)
        _swiglu_bwd_kernel[_grid(M, F)](h2d, dy.reshape(M, F).contiguous(), dh, M, F, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                        num_warps=4)
        return dh.view(*dy.shape[:-1], 2 * F)


def swiglu_fused(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2F] = [gate | up] -> silu(gate) * up [..., F]."""
    return _SwiGLUFn.apply(h)
