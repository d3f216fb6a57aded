"""Fused RMSNorm (and residual-add + RMSNorm) in Triton, forward and backward.

Same layout as ``layernorm_triton.py``: the forward is one program per row (the row read once,
statistics in fp32, 1/rms saved, 4 bytes a row); the backward is a persistent grid whose programs
walk rows (a few at a time), write dx, and keep their rows' dweight sum in registers (one fp32
partial row per program, summed by torch: no atomics, deterministic).

    y = w * x * r,  r = 1 / sqrt(mean(x^2) + eps)
    dx = r * (w dy - xhat * mean(w dy * xhat)),  xhat = x r;   dw = sum over rows of dy * xhat

With the residual add (the serial block's second norm), the forward also writes s = x + residual
(rounded to the stream's dtype, so exactly what is normalised) and the backward adds the gradient
arriving through s to dx. The output takes the autocast dtype under CUDA autocast, else the
promoted dtype of x and the weight (as the reference).

Measured on an H200 at [16384, 2048] bf16 (benchmarks/kernels.py, CUDA graph): forward +
backward 0.105 ms (76% of the copy rate; the reference under torch.compile 0.109 ms, which is
why compiled blocks keep inductor's). The residual-add variant took 0.289 ms against inductor's
0.142: its backward writes dx in fp32 and casts it for x and for the residual (two extra passes);
one dx in the shared dtype would remove them (not done).

This module imports Triton at the top: ``megatrain.kernels.rmsnorm`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels import sm_count
from megatrain.kernels.layernorm_triton import _block_and_warps, output_dtype


@triton.jit
def _rms_fwd_kernel(X, RES, SUM, Y, W, RSTD, N, eps, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(RES + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(SUM.dtype.element_ty)
        tl.store(SUM + row * N + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_kernel(X, DY, DX, DSUM, W, RSTD, DW_PART, M, N, ROWS_PER_PROGRAM: tl.constexpr,
                    ROWS_AT_ONCE: tl.constexpr, HAS_DSUM: tl.constexpr, BLOCK_N: tl.constexpr):
    # ROWS_PER_PROGRAM is a constexpr (one compile per row count) because Triton 3.5's interpreter
    # cannot loop to a runtime bound under numpy 2.4. A program walks its rows ROWS_AT_ONCE at a
    # time, as [ROWS_AT_ONCE, BLOCK_N] tiles: more loads in flight per program than one row each.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM, ROWS_AT_ONCE):
        local = i + tl.arange(0, ROWS_AT_ONCE)[:, None]  # [R, 1] rows of this program
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + local
        in_rows = (row < M) & (local < ROWS_PER_PROGRAM)
        tile_mask = mask[None, :] & in_rows
        offs = row * N + cols[None, :]
        x = tl.load(X + offs, mask=tile_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=tile_mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=in_rows, other=0.0)  # [R, 1]
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=1)[:, None] / N
        dx = (wdy - xhat * c) * rstd
        if HAS_DSUM:
            dx += tl.load(DSUM + offs, mask=tile_mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=tile_mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PART + pid * N + cols, dw, mask=mask)


# The backward's persistent grid: programs per SM, and rows each program holds at once. At
# moe-gpu-2b's [65536, 1024] bf16 with the skip's gradient on an H200 (benchmarks/rmsnorm_skip_bench.py,
# benchmarks/results/rmsnorm-skip-candidates-h200.json): 0.294 ms with LayerNorm's 4 programs per SM one row at a
# time, 0.221 with 8, 0.189 with 8 holding 4 rows (2.8 TB/s for its four passes; a copy runs at 3.6).
BWD_PROGRAMS_PER_SM = 8
BWD_ROWS_AT_ONCE = 4


def _forward(x2d, res2d, weight, eps, out_dtype):
    M, N = x2d.shape
    block, warps = _block_and_warps(N)
    summed = torch.empty((M, N), dtype=torch.result_type(x2d, res2d), device=x2d.device) if res2d is not None else None
    y = torch.empty((M, N), dtype=out_dtype, device=x2d.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x2d.device)
    _rms_fwd_kernel[(M,)](x2d, res2d if res2d is not None else x2d, summed if summed is not None else y, y, weight, rstd,
                          N, eps, HAS_RES=res2d is not None, BLOCK_N=block, num_warps=warps)
    return y, summed, rstd


def _backward(x2d, dy, dsum, weight, rstd, dx_dtype):
    M, N = x2d.shape
    block, warps = _block_and_warps(N)
    programs = max(1, min(M, BWD_PROGRAMS_PER_SM * sm_count(x2d.device)))
    rows_per_program = triton.cdiv(M, programs)
    programs = triton.cdiv(M, rows_per_program)
    dx = torch.empty((M, N), dtype=dx_dtype, device=x2d.device)
    dw_part = torch.empty((programs, N), dtype=torch.float32, device=x2d.device)
    _rms_bwd_kernel[(programs,)](x2d, dy, dx, dsum if dsum is not None else dy, weight, rstd, dw_part, M, N,
                                 ROWS_PER_PROGRAM=rows_per_program, ROWS_AT_ONCE=BWD_ROWS_AT_ONCE,
                                 HAS_DSUM=dsum is not None, BLOCK_N=block, num_warps=warps)
    return dx, dw_part.sum(0).to(weight.dtype)


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        shape = x.shape
        x2d, r2d = x.reshape(-1, shape[-1]).contiguous(), residual.reshape(-1, shape[-1]).contiguous()
        out_dtype = output_dtype(x, torch.promote_types(torch.promote_types(x.dtype, residual.dtype), weight.dtype))
        y, summed, rstd = _forward(x2d, r2d, weight, eps, out_dtype)
        ctx.save_for_backward(summed, weight, rstd)
        ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
        ctx.set_materialize_grads(False)
        return y.view(shape), summed.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dsum: torch.Tensor | None):
        summed, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(summed)
        dsum2d = dsum.reshape(summed.shape).contiguous() if dsum is not None else None
        dx, dw = _backward(summed, dy.reshape(summed.shape).contiguous(), dsum2d, weight, rstd, torch.float32)
        shape = dy.shape
        return dx.to(ctx.x_dtype).view(shape), dx.to(ctx.r_dtype).view(shape), dw, None


class _RMSNormFn(torch.autograd.Function):
    """(rms_norm(x), x): the norm, and x again for a skip connection around it (a serial block's
    first norm). The backward adds the skip's gradient to the norm's while it writes dx: one pass,
    where autograd would sum the two in a pass of its own (or inductor re-read them). The plain
    norm leaves the second output unused: its gradient is then None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, _, rstd = _forward(x2d, None, weight, eps, output_dtype(x, torch.promote_types(x.dtype, weight.dtype)))
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.set_materialize_grads(False)
        return y.view(x.shape), x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dskip: torch.Tensor | None):
        x2d, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(x2d.shape, dtype=x2d.dtype, device=x2d.device)
        dskip2d = dskip.reshape(x2d.shape).contiguous() if dskip is not None else None
        dx, dw = _backward(x2d, dy.reshape(x2d.shape).contiguous(), dskip2d, weight, rstd, x2d.dtype)
        return dx.view(dy.shape), dw, None


def rms_norm_with_skip_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)``, the second a view of x whose gradient the norm's backward adds."""
    return _RMSNormFn.apply(x, weight, eps)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNormFn.apply(x, weight, eps)[0]


def add_rms_norm_fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``s = x + residual; return rms_norm(s), s`` in one pass over memory."""
    return _AddRMSNormFn.apply(x, residual, weight, eps)
