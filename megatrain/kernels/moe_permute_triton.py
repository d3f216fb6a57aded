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
def _gather_sum_kernel(Y, ROW_OF_SLOT, W, OUT, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
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


def _block(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    return block, max(1, min(8, block // 256))  # BLOCK_D, num_warps


def scatter_rows(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """x [N, d] -> [N k, d]: out[row_of_slot[n k + j]] = x[n] (row_of_slot a permutation)."""
    x = x.contiguous()
    out = torch.empty((row_of_slot.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    block, warps = _block(x.shape[1])
    if x.shape[0]:
        _scatter_rows_kernel[(x.shape[0],)](x, row_of_slot, out, x.shape[1], K=k, BLOCK_D=block, num_warps=warps)
    return out


def gather_sum(y: torch.Tensor, row_of_slot: torch.Tensor, k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [N k, d] -> [N, d]: out[n] = sum_j (w[n k + j]) y[row_of_slot[n k + j]], in fp32."""
    y = y.contiguous()
    n = row_of_slot.numel() // k
    out = torch.empty((n, y.shape[1]), dtype=y.dtype, device=y.device)
    block, warps = _block(y.shape[1])
    w = weights.contiguous() if weights is not None else row_of_slot  # unread without HAS_W
    if n:
        _gather_sum_kernel[(n,)](y, row_of_slot, w, out, y.shape[1], K=k, HAS_W=weights is not None, BLOCK_D=block,
                                 num_warps=warps)
    return out


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
    """The weighted sum: its backward needs y (for dw)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
        k = weights.shape[1]
        w = weights.reshape(-1).float().contiguous()  # [N k]
        ctx.save_for_backward(y, w, row_of_slot)
        ctx.weights_dtype, ctx.k = weights.dtype, k
        return gather_sum(y, row_of_slot, k, w)  # [N, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, w, row_of_slot = ctx.saved_tensors
        y, dout = y.contiguous(), dout.contiguous()
        dy = torch.empty_like(y)
        dw = torch.empty_like(w)
        block, warps = _block(y.shape[1])
        if dout.shape[0]:
            _combine_bwd_kernel[(dout.shape[0],)](dout, y, row_of_slot, w, dy, dw, y.shape[1], K=ctx.k,
                                                  BLOCK_D=block, num_warps=warps)
        return dy, dw.view(-1, ctx.k).to(ctx.weights_dtype), None


class _SumFn(torch.autograd.Function):
    """The plain sum (weights applied inside the experts): its backward is a dispatch of dout."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(row_of_slot)
        ctx.k = k
        return gather_sum(y, row_of_slot, k)  # [N, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (row_of_slot,) = ctx.saved_tensors
        return scatter_rows(dout, row_of_slot, ctx.k), None, None


def dispatch_fused(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    return _DispatchFn.apply(x, row_of_slot, k)


def combine_fused(y: torch.Tensor, weights: torch.Tensor | None, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """y [N k, d] -> [N, d]; ``weights`` [N, k] or None (a plain sum)."""
    if weights is None:
        return _SumFn.apply(y, row_of_slot, k)
    return _CombineFn.apply(y, weights, row_of_slot)
