"""The experts' first projection with its row gather and SwiGLU fused in (issue 32's lever).

Today's forward of the experts (``model/moe_experts.py``) is three passes over the routed rows:

    rows = x[order // k]                  gather: writes [M, d]         (kernels/moe_permute.py)
    h    = rows @ fc[e]^T per segment     CUTLASS grouped GEMM: writes [M, 2 ff]
    act  = silu(h_gate) * h_up            SwiGLU: reads [M, 2 ff], writes [M, ff]

``gathered_swiglu_mm`` (``moe_gemm_triton.py``) computes ``act`` and ``h`` (which SwiGLU's backward
reads) in one Triton grouped GEMM: each tile loads its A rows straight from ``x`` through the
token index and holds the gate and up columns of the same outputs side by side, so SwiGLU is the
epilogue and the gathered copy of the rows is never written. This module holds the plain
reference and the tiling; ``benchmarks/moe_gemm.py`` measures the kernel against the three passes
on a GPU. It is not wired into the model until it beats them: CUTLASS's grouped GEMM runs at
~560 TFLOP/s on an H100, and a Triton GEMM whose A loads go through an index cannot use TMA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gathered_swiglu_mm_reference(x: torch.Tensor, row_src: torch.Tensor, counts: torch.Tensor,
                                 fc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] tokens, row_src [M] the token of each expert-ordered row, counts [E] rows per
    expert, fc [E, 2 ff, d] (gate rows, then up rows) -> (act [M, ff], h [M, 2 ff])."""
    rows = x[row_src].float()  # [M, d]
    h = torch.empty(rows.shape[0], fc.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # a host sync: the reference, not the fast path
        h[start:start + n] = rows[start:start + n] @ fc[e].float().T
        start += n
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype), h.to(x.dtype)


def gathered_wgrad_reference(x: torch.Tensor, row_src: torch.Tensor, counts: torch.Tensor,
                             dh: torch.Tensor) -> torch.Tensor:
    """The first projection's weight gradient, the rows gathered as the forward gathered them:
    dfc[e] = sum over expert e's rows r of dh[r]^T x[row_src[r]] -> [E, 2 ff, d] (fp32 sums)."""
    rows = x[row_src].float()  # [M, d]
    out = torch.zeros(counts.numel(), dh.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        out[e] = dh[start:start + n].float().T @ rows[start:start + n]
        start += n
    return out.to(x.dtype)


def segment_tiles(counts: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's row segment cut into ``block_m`` tiles, on the device (no host sync):
    (expert of each tile, first row of each tile), ``cdiv(n_rows, block_m) + E`` tiles, enough for
    any split of ``n_rows`` rows; the spare tiles get expert E, which the kernel skips."""
    n_experts = counts.numel()
    n_tiles = -(-n_rows // block_m) + n_experts
    tiles = (counts + block_m - 1) // block_m  # [E] tiles per expert
    tile_end = torch.cumsum(tiles, 0)  # [E]
    t = torch.arange(n_tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # [n_tiles]; E past the last tile
    valid = expert.clamp(max=n_experts - 1)
    seg_start = torch.cumsum(counts, 0) - counts  # [E] first row of each segment
    first_row = seg_start[valid] + (t - (tile_end - tiles)[valid]) * block_m
    return expert.to(torch.int32), first_row.to(torch.int32)


def gathered_swiglu_mm(x: torch.Tensor, row_src: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor,
                       block_m: int = 128, block_n: int = 64, block_k: int = 64, num_warps: int = 8,
                       num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused forward (Triton: a CUDA device, or ``TRITON_INTERPRET=1`` for tests), the same
    contract as ``gathered_swiglu_mm_reference``; the block sizes and launch settings are tunable
    (``benchmarks/moe_gemm.py`` sweeps them)."""
    from megatrain.kernels.moe_gemm_triton import gathered_swiglu_mm_triton

    tile_expert, tile_row = segment_tiles(counts, row_src.numel(), block_m)
    seg_end = torch.cumsum(counts, 0).to(torch.int32)
    return gathered_swiglu_mm_triton(x, row_src, tile_expert, tile_row, seg_end, fc, block_m, block_n, block_k,
                                     num_warps, num_stages)


def gathered_wgrad(x: torch.Tensor, row_src: torch.Tensor, counts: torch.Tensor, dh: torch.Tensor,
                   block_n: int = 128, block_k: int = 128, block_r: int = 32, num_warps: int = 8,
                   num_stages: int = 3) -> torch.Tensor:
    """The fused weight gradient (Triton), ``gathered_wgrad_reference``'s contract: the rows are
    read from ``x`` through ``row_src``, so the forward need not keep a gathered copy for it."""
    from megatrain.kernels.moe_gemm_triton import gathered_wgrad_triton

    seg_end = torch.cumsum(counts, 0).to(torch.int32)
    return gathered_wgrad_triton(x, row_src, seg_end - counts.to(torch.int32), seg_end, dh, block_n, block_k,
                                 block_r, num_warps, num_stages)
