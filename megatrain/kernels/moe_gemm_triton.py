"""Triton: the experts' first grouped GEMM with the row gather in its loads and SwiGLU in its
epilogue, and its weight gradient reading the rows through the same gather (``moe_gemm.py`` has
the references and the why).

One program computes a [BLOCK_M, BLOCK_N] tile of ``act`` for one expert: BLOCK_M of the expert's
rows, whose A rows it loads from ``x`` through ``row_src``, and BLOCK_N gate columns with the
BLOCK_N up columns of the same outputs (two accumulators over the same A tile), so the SwiGLU of
the tile needs nothing from another program. It also writes both halves of ``h`` for SwiGLU's
backward. Accumulation in fp32; outputs in x's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gathered_swiglu_mm_kernel(
    X, ROW_SRC, TILE_EXPERT, TILE_ROW, SEG_END, W, ACT, H,
    n_experts, D: tl.constexpr, FF: tl.constexpr,  # the model's widths: one compile per model
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # the column tiles of one row tile are neighbours in launch order: they run together, so the
    # gathered A rows are read from HBM once and then from L2 (and an expert's weights stay in L2
    # across its row tiles)
    n_col_tiles: tl.constexpr = (FF + BLOCK_N - 1) // BLOCK_N
    tile, pid_n = tl.program_id(0) // n_col_tiles, tl.program_id(0) % n_col_tiles
    e = tl.load(TILE_EXPERT + tile)
    if e >= n_experts:  # a spare tile of the fixed grid
        return
    row0 = tl.load(TILE_ROW + tile)
    end = tl.load(SEG_END + e)
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM] expert-ordered rows
    row_ok = rows < end
    # rows past the segment read token 0 and columns past ff read column ff - 1: real memory whose
    # results are never stored, so the main loop needs no row or column mask
    src = tl.load(ROW_SRC + rows, mask=row_ok, other=0).to(tl.int64)  # their tokens
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (of ff)
    col_ok = cols < FF
    if FF % BLOCK_N == 0:  # compile time; a clamp would hide the columns' contiguity from Triton
        w_cols = cols.to(tl.int64)
    else:
        w_cols = tl.minimum(cols, FF - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_e = W + e.to(tl.int64) * (2 * FF) * D  # fc[e]: [2 ff, d], gate rows then up rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + ks
        if D % BLOCK_K == 0:  # resolved at compile time: no K mask when the tiles divide d
            a = tl.load(X + src[:, None] * D + k[None, :])
            gate_w = tl.load(w_e + w_cols[None, :] * D + k[:, None])
            up_w = tl.load(w_e + (FF + w_cols[None, :]) * D + k[:, None])
        else:
            k_ok = k < D
            a = tl.load(X + src[:, None] * D + k[None, :], mask=k_ok[None, :], other=0.0)
            gate_w = tl.load(w_e + w_cols[None, :] * D + k[:, None], mask=k_ok[:, None], other=0.0)
            up_w = tl.load(w_e + (FF + w_cols[None, :]) * D + k[:, None], mask=k_ok[:, None], other=0.0)
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
        acc_up = tl.dot(a, up_w, acc_up, input_precision=PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    tl.store(ACT + rows64 * FF + cols[None, :], act.to(ACT.dtype.element_ty), mask=out_mask)
    tl.store(H + rows64 * (2 * FF) + cols[None, :], acc_gate.to(H.dtype.element_ty), mask=out_mask)
    tl.store(H + rows64 * (2 * FF) + FF + cols[None, :], acc_up.to(H.dtype.element_ty), mask=out_mask)


def _precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full precision (the references' contract); 16-bit ones as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gathered_swiglu_mm_triton(x: torch.Tensor, row_src: torch.Tensor, tile_expert: torch.Tensor,
                              tile_row: torch.Tensor, seg_end: torch.Tensor, fc: torch.Tensor, block_m: int,
                              block_n: int, block_k: int, num_warps: int,
                              num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d], row_src [M], the tiles of ``moe_gemm.segment_tiles`` (made with ``block_m``),
    seg_end [E] int32, fc [E, 2 ff, d] -> (act [M, ff], h [M, 2 ff])."""
    n_experts, two_ff, d = fc.shape
    ff, m = two_ff // 2, row_src.numel()
    act = torch.empty(m, ff, dtype=x.dtype, device=x.device)
    h = torch.empty(m, two_ff, dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel() * triton.cdiv(ff, block_n),)
    _gathered_swiglu_mm_kernel[grid](x.contiguous(), row_src.contiguous(), tile_expert, tile_row, seg_end,
                                     fc.contiguous(), act, h, n_experts, D=d, FF=ff, BLOCK_M=block_m,
                                     BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype),
                                     num_warps=num_warps, num_stages=num_stages)
    return act, h


@triton.jit
def _wgrad_rows(X, ROW_SRC, DH, acc, r0, end, ns, ks, D: tl.constexpr, TWO_FF: tl.constexpr,
                BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """acc [BN, BK] += dh[r0:r0+BR, n-tile]^T x[row_src[r0:r0+BR], k-tile]. ``ns`` and ``ks`` lie
    inside the matrices (clamped by the caller where the tiles do not divide them; those results
    are not stored); a MASKED chunk (the segment's tail) zeroes dh's rows past ``end``, the only
    mask the sum needs."""
    rows = r0 + tl.arange(0, BLOCK_R)
    if MASKED:
        r_ok = rows < end
        src = tl.load(ROW_SRC + rows, mask=r_ok, other=0).to(tl.int64)
        g = tl.load(DH + rows.to(tl.int64)[None, :] * TWO_FF + ns[:, None], mask=r_ok[None, :], other=0.0)
    else:
        src = tl.load(ROW_SRC + rows).to(tl.int64)
        g = tl.load(DH + rows.to(tl.int64)[None, :] * TWO_FF + ns[:, None])  # [BN, BR]: dh's tile, transposed
    a = tl.load(X + src[:, None] * D + ks[None, :])  # [BR, BK]
    return tl.dot(g, a, acc, input_precision=PRECISION)


@triton.jit
def _gathered_wgrad_kernel(X, ROW_SRC, SEG_START, SEG_END, DH, DW,
                           D: tl.constexpr, TWO_FF: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                           PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """dw[e, n-tile, k-tile] = sum over expert e's rows of dh[r, n-tile]^T x[row_src[r], k-tile]."""
    # one expert's tiles are neighbours in launch order: they run together and share its rows in L2
    n_tiles: tl.constexpr = (TWO_FF + BLOCK_N - 1) // BLOCK_N
    k_tiles: tl.constexpr = (D + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    e, pid_n, pid_k = pid // (n_tiles * k_tiles), (pid // k_tiles) % n_tiles, pid % k_tiles
    start, end = tl.load(SEG_START + e), tl.load(SEG_END + e)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if TWO_FF % BLOCK_N == 0 and D % BLOCK_K == 0:  # compile time: every index is inside
        ns_in, ks_in = ns, ks  # (a clamp would hide their contiguity from Triton: unvectorized loads)
    else:
        ns_in, ks_in = tl.minimum(ns, TWO_FF - 1), tl.minimum(ks, D - 1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    full_end = start + (end - start) // BLOCK_R * BLOCK_R
    if INTERPRETED:  # the interpreter cannot take a loaded value as a range bound; a while loop it can
        r0 = start
        while r0 < full_end:
            acc = _wgrad_rows(X, ROW_SRC, DH, acc, r0, end, ns_in, ks_in, D, TWO_FF, BLOCK_R, PRECISION, False)
            r0 += BLOCK_R
    else:  # compiled: a for loop, which Triton software-pipelines (num_stages)
        for r0 in range(start, full_end, BLOCK_R):  # the expert's whole chunks of rows: the reduction
            acc = _wgrad_rows(X, ROW_SRC, DH, acc, r0, end, ns_in, ks_in, D, TWO_FF, BLOCK_R, PRECISION, False)
    if full_end < end:
        acc = _wgrad_rows(X, ROW_SRC, DH, acc, full_end, end, ns_in, ks_in, D, TWO_FF, BLOCK_R, PRECISION, True)
    out = DW + e.to(tl.int64) * TWO_FF * D
    tl.store(out + ns[:, None].to(tl.int64) * D + ks[None, :], acc.to(DW.dtype.element_ty),
             mask=(ns < TWO_FF)[:, None] & (ks < D)[None, :])


def gathered_wgrad_triton(x: torch.Tensor, row_src: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor,
                          dh: torch.Tensor, block_n: int, block_k: int, block_r: int, num_warps: int,
                          num_stages: int) -> torch.Tensor:
    """x [N, d], row_src [M], seg_start/seg_end [E] int32, dh [M, 2 ff] -> dfc [E, 2 ff, d]."""
    n_experts, (m, two_ff), d = seg_end.numel(), dh.shape, x.shape[1]
    dw = torch.empty(n_experts, two_ff, d, dtype=x.dtype, device=x.device)
    grid = (n_experts * triton.cdiv(two_ff, block_n) * triton.cdiv(d, block_k),)
    _gathered_wgrad_kernel[grid](x.contiguous(), row_src.contiguous(), seg_start, seg_end, dh.contiguous(), dw,
                                 D=d, TWO_FF=two_ff, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r,
                                 PRECISION=_precision(x.dtype),
                                 INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
                                 num_warps=num_warps, num_stages=num_stages)
    return dw
