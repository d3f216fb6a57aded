"""The MoE router's selection in Triton: each token's top-k experts, and the tokens per expert.

    topk_fused     experts[n] = the k largest of scores[n] + bias, best first   [N, E] -> [N, k]
    counts_fused   counts[e]  = #{slots s : experts[s] == e}                     [N k] -> [E]

torch's top-k over a row of 64 scores is a general radix select plus a sort of the k results:
on moe-gpu-2b (32,768 tokens, 64 experts, top-8; an H200) its two kernels took 140 us per layer,
and the counts' ``scatter_add_`` of 262,144 ones into 64 bins (every slot an atomic on one of 64
addresses) another 85 us. Here a program holds a block of rows in registers and takes the
maximum k times (E is small); the counts are a per-block one-hot sum, one atomic per expert and
block: 32 and 14 us per layer at twice those tokens. The recipe at micro-batch 32 and its global
batch: 174,154 against 171,629 tokens/s (``benchmarks/mfu.py --variants router-reference``).
Ties go to the lower expert id; a NaN score ranks above every number, as in torch.topk.

This module imports Triton at the top: ``megatrain.kernels.moe_router`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_kernel(S, BIAS, OUT, N, E: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < N
    col_ok = cols < E
    s = tl.load(S + rows[:, None].to(tl.int64) * E + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    s = s.to(tl.float32) + tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.where(s != s, float("inf"), s)  # NaN first, as torch.topk
    taken = ~col_ok[None, :] | (rows[:, None] < 0)  # [BLOCK_N, BLOCK_E]: padding columns count as taken
    for j in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), s), axis=1)  # [BLOCK_N]
        hit = ~taken & (s == best[:, None])  # a row of all -inf left still has untaken columns equal to best
        pick = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)  # the lowest id among the ties
        tl.store(OUT + rows.to(tl.int64) * K + j, pick.to(tl.int64), mask=row_ok)
        taken = taken | (cols[None, :] == pick[:, None])


@triton.jit
def _counts_kernel(IDS, COUNTS, M, E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(IDS + slots, mask=slots < M, other=-1)
    cols = tl.arange(0, BLOCK_E)
    per_expert = tl.sum((ids[:, None] == cols[None, :]).to(tl.int64), axis=0)  # [BLOCK_E]
    tl.atomic_add(COUNTS + cols, per_expert, mask=(cols < E) & (per_expert > 0))


def topk_fused(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, E], bias [E] -> [N, k] int64 expert ids of the k largest scores + bias, best first."""
    scores = scores.contiguous()
    n, e = scores.shape
    out = torch.empty((n, k), dtype=torch.int64, device=scores.device)
    block_e = triton.next_power_of_2(e)
    block_n = max(1, min(64, 4096 // block_e))
    if n:
        _topk_kernel[(triton.cdiv(n, block_n),)](scores, bias.contiguous(), out, n, E=e, K=k, BLOCK_N=block_n,
                                                  BLOCK_E=block_e, num_warps=4)
    return out


def counts_fused(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """experts (any shape, int64 ids in [0, n_experts)) -> [n_experts] int64 slots per expert."""
    ids = experts.reshape(-1).contiguous()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    block_e = triton.next_power_of_2(n_experts)
    block_m = max(16, min(1024, 65536 // block_e))
    if ids.numel():
        _counts_kernel[(triton.cdiv(ids.numel(), block_m),)](ids, counts, ids.numel(), E=n_experts, BLOCK_M=block_m,
                                                              BLOCK_E=block_e, num_warps=4)
    return counts
