"""The MoE permutation in Triton: no atomics, every output row written once.

N tokens each choose k experts: N k slots, slot s = token s // k's (s % k)-th choice. ``order``
[N k] lists the slots grouped by expert (row r of the experts' input is slot order[r]);
``row_of_slot`` [N k] is its inverse. With x [N, d], the experts' output y [N k, d] and the
router's weights w [N k]:

    dispatch   rows[row_of_slot[n k + j]] = x[n]           backward  dx[n] = sum_j drows[row_of_slot[n k + j]]
    combine    out[n] = sum_j (w[n k + j]) y[row_of_slot[n k + j]]
               backward  dy[row_of_slot[n k + j]] = (w[n k + j]) dout[n],   dw[n k + j] = <dout[n], y[row ...]>

Every kernel walks the tokens, one program per token: it reads its own row (x, or dout) once and
its k rows in expert order wherever they are. Walking the experts' rows instead (``rows[r] =
x[order[r] // k]``) reads each token's row k times, in an order that jumps over all of x; once x
outgrows the L2 cache (moe-gpu-2b at micro-batch 32: 128 MB, an H200's L2 is 50 MB) that is k
reads from memory per token, and the dispatch ran at half the copy rate (0.56 ms a layer, where
the bytes it must move take 0.27). The combine's weights are optional: ``model/moe.py`` applies
them inside the experts (``kernels/swiglu.py``'s ``scale``) when the experts are local, so that
backward reads no y; expert parallelism keeps them here.

The index-op reference (``moe_permute.py``) writes the slots in token order first (index_copy)
and scatters the dispatch gradient back with atomic adds; here sums run in fp32.

This module imports Triton at the top: ``megatrain.kernels.moe_permute`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_rows_kernel(X, ROW_OF_SLOT, OUT, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + n.to(tl.int64) * D + cols, mask=mask)
    for j in tl.static_range(K):
        row = tl.load(ROW_OF_SLOT + n * K + j).to(tl.int64)
        tl.store(OUT + row * D + cols, x, mask=mask)


@triton.jit
def _gather_sum_kernel(Y, ROW_OF_SLOT, W, RES, OUT, D, K: tl.constexpr, HAS_W: tl.constexpr, HAS_RES: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_RES:
        acc += tl.load(RES + n.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        row = tl.load(ROW_OF_SLOT + n * K + j).to(tl.int64)
        y = tl.load(Y + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(W + n * K + j)
        acc += y
    tl.store(OUT + n.to(tl.int64) * D + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(DOUT, Y, ROW_OF_SLOT, W, DY, DW, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    g = tl.load(DOUT + n.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        slot = n * K + j
        row = tl.load(ROW_OF_SLOT + slot).to(tl.int64)
        y = tl.load(Y + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DY + row * D + cols, (g * tl.load(W + slot)).to(DY.dtype.element_ty), mask=mask)
        tl.store(DW + slot, tl.sum(g * y, axis=0))


# Warps of each kernel (None: one per 256 columns, at most 8). benchmarks/moe_permute.py --sweep
# times the alternatives: at moe-gpu-2b's 65,536 tokens on an H200 (benchmarks/moe-permute-sweep-
# h200.json) scatter_rows stays at 3.2 TB/s and gather_sum at 3.9 at every launch shape tried
# (2-8 warps, and 1-4 tokens a program, which gained nothing and was dropped); combine_bwd runs 5%
# faster on 2 warps than on 4.
WARPS: dict[str, int | None] = {"scatter_rows": None, "gather_sum": None, "combine_bwd": 2}


def launch_options(kernel: str, d: int) -> dict:
    """BLOCK_D and num_warps of ``kernel`` (one program per token) over rows of width d."""
    block = triton.next_power_of_2(d)
    return {"BLOCK_D": block, "num_warps": WARPS[kernel] or max(1, min(8, block // 256))}


def scatter_rows(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """x [N, d] -> [N k, d]: out[row_of_slot[n k + j]] = x[n] (row_of_slot a permutation)."""
    x = x.contiguous()
    n, d = x.shape
    out = torch.empty((row_of_slot.numel(), d), dtype=x.dtype, device=x.device)
    if n:
        _scatter_rows_kernel[(n,)](x, row_of_slot, out, d, K=k, **launch_options("scatter_rows", d))
    return out


def gather_sum(y: torch.Tensor, row_of_slot: torch.Tensor, k: int, weights: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [N k, d] -> [N, d]: out[n] = (residual[n]) + sum_j (w[n k + j]) y[row_of_slot[n k + j]], in fp32."""
    y = y.contiguous()
    n, d = row_of_slot.numel() // k, y.shape[1]
    out = torch.empty((n, d), dtype=y.dtype, device=y.device)
    w = weights.contiguous() if weights is not None else row_of_slot  # unread without HAS_W
    res = residual.reshape(n, d).contiguous() if residual is not None else y  # unread without HAS_RES
    if n:
        _gather_sum_kernel[(n,)](y, row_of_slot, w, res, out, d, K=k, HAS_W=weights is not None,
                                 HAS_RES=residual is not None, **launch_options("gather_sum", d))
    return out


def combine_bwd(dout: torch.Tensor, y: torch.Tensor, row_of_slot: torch.Tensor, w: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted combine's backward: (dy [N k, d], dw [N k] fp32)."""
    y, dout = y.contiguous(), dout.contiguous()
    dy, dw = torch.empty_like(y), torch.empty_like(w)
    n, d = dout.shape
    if n:
        _combine_bwd_kernel[(n,)](dout, y, row_of_slot, w, dy, dw, d, K=k, **launch_options("combine_bwd", d))
    return dy, dw


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(row_of_slot)
        ctx.k = k
        return scatter_rows(x, row_of_slot, k)  # [N k, d]

    @staticmethod
    def backward(ctx, drows: torch.Tensor):
        (row_of_slot,) = ctx.saved_tensors
        return gather_sum(drows, row_of_slot, ctx.k), None, None


class _CombineFn(torch.autograd.Function):
    """(residual) + the (weighted) sum. Weighted, the backward reads y for the weights' gradient,
    so y is kept; plain (the weights applied inside the experts), the backward is a dispatch of
    dout and keeps nothing but the permutation."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor | None, row_of_slot: torch.Tensor, k: int,
                residual: torch.Tensor | None) -> torch.Tensor:
        w = weights.reshape(-1).float().contiguous() if weights is not None else None  # [N k]
        ctx.save_for_backward(row_of_slot, *((y, w) if w is not None else ()))
        ctx.k, ctx.weights_dtype = k, weights.dtype if weights is not None else None
        return gather_sum(y, row_of_slot, k, w, residual)  # [N, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        row_of_slot, *weighted = ctx.saved_tensors
        dresidual = dout if ctx.needs_input_grad[4] else None
        if not weighted:
            return scatter_rows(dout, row_of_slot, ctx.k), None, None, None, dresidual
        y, w = weighted
        dy, dw = combine_bwd(dout, y, row_of_slot, w, ctx.k)
        return dy, dw.view(-1, ctx.k).to(ctx.weights_dtype), None, None, dresidual


def dispatch_fused(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    return _DispatchFn.apply(x, row_of_slot, k)


def combine_fused(y: torch.Tensor, weights: torch.Tensor | None, row_of_slot: torch.Tensor, k: int,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [N k, d] -> [N, d]; ``weights`` [N, k] or None (a plain sum); ``residual`` [N, d] added."""
    return _CombineFn.apply(y, weights, row_of_slot, k, residual)
