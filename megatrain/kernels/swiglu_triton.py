"""Fused SwiGLU (silu(gate) * up) in Triton, forward and backward.

h = [gate | up] is one [M, 2F] tensor (the output of the fused gate/up matmul). Both kernels walk
2D tiles [rows, cols] of the [M, F] output; the backward writes d[gate | up] into one [M, 2F]
buffer, which is the matmul's output gradient as it is (no concatenation). It saves only h.

    y = c g s u,  s = sigmoid(g);   dg = c dy u s (1 + g (1 - s)),  du = c dy g s,  dc = <dy, g s u>

where c is the row's ``scale`` (1 without one). With a scale the backward walks whole rows (a
program loops over the columns), so each row's dc is one fp32 sum, written once: no atomics.

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
def _swiglu_fwd_kernel(H, SCALE, Y, M, F, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    gate_offs = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g = tl.load(H + gate_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    if HAS_SCALE:
        y = y * tl.load(SCALE + rows, mask=rows < M, other=0.0)[:, None]
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


@triton.jit
def _swiglu_scaled_bwd_kernel(H, DY, SCALE, DH, DSCALE, M, F: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    # F is a compile-time constant (one compile per expert width): Triton's interpreter cannot
    # loop to a run-time bound with NumPy 2
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    c = tl.load(SCALE + rows, mask=row_mask, other=0.0)[:, None]
    dc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, F, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < F)[None, :]
        gate_offs = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
        g = tl.load(H + gate_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(H + gate_offs + F, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows.to(tl.int64)[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dc += tl.sum(dy * g * s * u, axis=1)
        dy = dy * c
        tl.store(DH + gate_offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + gate_offs + F, (dy * g * s).to(DH.dtype.element_ty), mask=mask)
    tl.store(DSCALE + rows, dc, mask=row_mask)


def _grid(M: int, F: int) -> tuple[int, int]:
    return triton.cdiv(M, BLOCK_M), triton.cdiv(F, BLOCK_N)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        h2d = h.reshape(-1, h.shape[-1]).contiguous()
        M, F = h2d.shape[0], h2d.shape[1] // 2
        y = torch.empty((M, F), dtype=h.dtype, device=h.device)
        c = scale.reshape(M).float().contiguous() if scale is not None else h2d  # unread without HAS_SCALE
        _swiglu_fwd_kernel[_grid(M, F)](h2d, c, y, M, F, HAS_SCALE=scale is not None, BLOCK_M=BLOCK_M,
                                        BLOCK_N=BLOCK_N, num_warps=4)
        ctx.save_for_backward(h2d, c if scale is not None else None)
        ctx.scale_dtype = scale.dtype if scale is not None else None
        return y.view(*h.shape[:-1], F)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h2d, c = ctx.saved_tensors
        M, F = h2d.shape[0], h2d.shape[1] // 2
        dh = torch.empty_like(h2d)
        dy2d = dy.reshape(M, F).contiguous()
        if c is None:
            _swiglu_bwd_kernel[_grid(M, F)](h2d, dy2d, dh, M, F, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
            return dh.view(*dy.shape[:-1], 2 * F), None
        dc = torch.empty_like(c)
        _swiglu_scaled_bwd_kernel[(triton.cdiv(M, BLOCK_M),)](h2d, dy2d, c, dh, dc, M, F, BLOCK_M=BLOCK_M,
                                                             BLOCK_N=BLOCK_N, num_warps=4)
        return dh.view(*dy.shape[:-1], 2 * F), dc.view(dy.shape[:-1]).to(ctx.scale_dtype)


def swiglu_fused(h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """h [..., 2F] = [gate | up], scale [...] or None -> scale * silu(gate) * up [..., F]."""
    return _SwiGLUFn.apply(h, scale)
