"""LM head + cross-entropy on GPU: one chunk's softmax, loss and gradient in one Triton kernel, in
place on the logits. ``cross_entropy.py`` runs its chunked loop with this as the chunk function
(``lm_head_cross_entropy_fused``).

Per chunk the plain-torch version makes an fp32 copy of the logits and passes over it about six
times (logsumexp, gather, subtract, exp, scale, cast back). The kernel instead reads the
bf16 logits twice (an online max/sum-exp pass, then the gradient pass) and overwrites them with
dlogits: 3 x 2 bytes per logit instead of roughly 30, and no fp32 chunk in memory.

At moe-gpu-2b's micro-batch of 32 (logits [65536, 50304], 6.6 GB) it takes 4.92 ms on an H200:
the two reads and the write at 4.0 TB/s, the copy rate. A persistent grid that keeps few enough
rows in flight for the second read to come from L2 (1-8 programs per SM, 8-16 warps, blocks of
4096-8192, evict-last/evict-first hints) measured 5.57-11.4 ms in every combination: too few
loads in flight to keep memory busy (``benchmarks/results/ce-launch-sweep-h200.json``; the option was
removed after the sweep).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_ce_kernel(
    LOGITS, TARGETS, LOSS, SCALE, ignore_index,
    V: tl.constexpr, NEED_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # V is a constexpr (one compile per vocabulary) because Triton 3.5's interpreter cannot loop to
    # a runtime bound under numpy 2.4.
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * V
    target = tl.load(TARGETS + row)
    # Pass 1: running max m and sum of exp(x - m) over vocabulary blocks, all in fp32.
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(base + safe_target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
    if NEED_GRAD:
        # Pass 2: dlogits = (softmax - onehot(target)) / n_valid, written over the logits.
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
            tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=cols < V)


def softmax_cross_entropy_chunk_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                                       need_grad: bool, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ChunkFn (see cross_entropy.py, with its ``ignore_index`` bound) on the GPU; returns ``logits``
    itself, overwritten, as dlogits."""
    C, V = logits.shape
    assert logits.is_contiguous() and targets.is_contiguous()
    loss = torch.empty(C, dtype=torch.float32, device=logits.device)
    _softmax_ce_kernel[(C,)](
        logits, targets, loss, scale.reshape(1).float(), ignore_index,
        V=V, NEED_GRAD=need_grad, BLOCK_V=4096, num_warps=8,
    )
    return loss.sum(), (logits if need_grad else None)
