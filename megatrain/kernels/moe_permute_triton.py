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
def _scatter_rows_kernel(X, ROW_OF_SLOT, OUT, N, D, K: tl.constexpr, TOKENS: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    for t in tl.static_range(TOKENS):
        n = tl.program_id(0) * TOKENS + t
        if n < N:
            x = tl.load(X + n.to(tl.int64) * D + cols, mask=mask)
            for j in tl.static_range(K):
                row = tl.load(ROW_OF_SLOT + n * K + j).to(tl.int64)
                tl.store(OUT + row * D + cols, x, mask=mask)


@triton.jit
def _gather_sum_kernel(Y, ROW_OF_SLOT, W, RES, OUT, N, D, K: tl.constexpr, HAS_W: tl.constexpr, HAS_RES: tl.constexpr,
                       TOKENS: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    for t in tl.static_range(TOKENS):
        n = tl.program_id(0) * TOKENS + t
        if n < N:
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
def _combine_bwd_kernel(DOUT, Y, ROW_OF_SLOT, W, DY, DW, N, D, K: tl.constexpr, TOKENS: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    for t in tl.static_range(TOKENS):
        n = tl.program_id(0) * TOKENS + t
        if n < N:
            g = tl.load(DOUT + n.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(K):
                slot = n * K + j
                row = tl.load(ROW_OF_SLOT + slot).to(tl.int64)
                y = tl.load(Y + row * D + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(DY + row * D + cols, (g * tl.load(W + slot)).to(DY.dtype.element_ty), mask=mask)
                tl.store(DW + slot, tl.sum(g * y, axis=0))


# Launch shape of each kernel: (tokens per program, warps; None: one warp per 256 columns, at most 8).
# benchmarks/moe_permute.py --sweep times the alternatives: at moe-gpu-2b's 65,536 tokens on an H200
# (benchmarks/moe-permute-sweep-h200.json) scatter_rows stays at 3.2 TB/s and gather_sum at 3.9 at
# every shape tried (1-4 tokens, 2-8 warps); combine_bwd runs 5% faster on 2 warps than on 4.
LAUNCH: dict[str, tuple[int, int | None]] = {"scatter_rows": (1, None), "gather_sum": (1, None), "combine_bwd": (1, 2)}


def _launch(kernel: str, n: int, d: int) -> tuple[tuple[int], dict]:
    """The grid and the launch options of ``kernel`` over n tokens of width d."""
    tokens, warps = LAUNCH[kernel]
    block = triton.next_power_of_2(d)
    return (triton.cdiv(n, tokens),), {"TOKENS": tokens, "BLOCK_D": block, "num_warps": warps or max(1, min(8, block // 256))}


def scatter_rows(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """x [N, d] -> [N k, d]: out[row_of_slot[n k + j]] = x[n] (row_of_slot a permutation)."""
    x = x.contiguous()
    n, d = x.shape
    out = torch.empty((row_of_slot.numel(), d), dtype=x.dtype, device=x.device)
    if n:
        grid, opts = _launch("scatter_rows", n, d)
        _scatter_rows_kernel[grid](x, row_of_slot, out, n, d, K=k, **opts)
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
        grid, opts = _launch("gather_sum", n, d)
        _gather_sum_kernel[grid](y, row_of_slot, w, res, out, n, d, K=k, HAS_W=weights is not None,
                                 HAS_RES=residual is not None, **opts)
    return out


def combine_bwd(dout: torch.Tensor, y: torch.Tensor, row_of_slot: torch.Tensor, w: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted combine's backward: (dy [N k, d], dw [N k] fp32)."""
    y, dout = y.contiguous(), dout.contiguous()
    dy, dw = torch.empty_like(y), torch.empty_like(w)
    n, d = dout.shape
    if n:
        grid, opts = _launch("combine_bwd", n, d)
        _combine_bwd_kernel[grid](dout, y, row_of_slot, w, dy, dw, n, d, K=k, **opts)
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
    """The weighted sum (+ the residual): its backward needs y (for dw)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor,
                residual: torch.Tensor | None) -> torch.Tensor:
        k = weights.shape[1]
        w = weights.reshape(-1).float().contiguous()  # [N k]
        ctx.save_for_backward(y, w, row_of_slot)
        ctx.weights_dtype, ctx.k = weights.dtype, k
        return gather_sum(y, row_of_slot, k, w, residual)  # [N, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, w, row_of_slot = ctx.saved_tensors
        dy, dw = combine_bwd(dout, y, row_of_slot, w, ctx.k)
        return dy, dw.view(-1, ctx.k).to(ctx.weights_dtype), None, dout if ctx.needs_input_grad[3] else None


class _SumFn(torch.autograd.Function):
    """The plain sum (weights applied inside the experts; + the residual): its backward is a
    dispatch of dout."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, row_of_slot: torch.Tensor, k: int, residual: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(row_of_slot)
        ctx.k = k
        return gather_sum(y, row_of_slot, k, None, residual)  # [N, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (row_of_slot,) = ctx.saved_tensors
        return scatter_rows(dout, row_of_slot, ctx.k), None, None, dout if ctx.needs_input_grad[3] else None


def dispatch_fused(x: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    return _DispatchFn.apply(x, row_of_slot, k)


def combine_fused(y: torch.Tensor, weights: torch.Tensor | None, row_of_slot: torch.Tensor, k: int,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [N k, d] -> [N, d]; ``weights`` [N, k] or None (a plain sum); ``residual`` [N, d] added."""
    if weights is None:
        return _SumFn.apply(y, row_of_slot, k, residual)
    return _CombineFn.apply(y, weights, row_of_slot, residual)
