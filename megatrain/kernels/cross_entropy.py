"""LM head + cross-entropy. The reference builds the full logits; faster versions avoid
materialising fp32 logits for the whole batch.

At 1.3B shapes (16384 tokens x 50304 vocab) the reference's logits are 1.6 GB in bf16 and its
fp32 softmax another 3.3 GB kept for the backward. The chunked version walks over row chunks:

    for each chunk of rows:   logits = h_c @ W^T                      (input dtype, [C, V])
                              loss  += logsumexp(logits) - logits[target]   (fp32)
                              dlogits = (softmax(logits) - onehot) / n_valid
                              dh_c   = dlogits @ W ;  dW += dlogits^T @ h_c

Because the loss is a scalar at the end of the graph, the gradients are computed in the forward
(when a backward will follow), one chunk at a time, and the backward only scales them by the
incoming gradient. Peak extra memory is one chunk of logits plus dW (in fp32 when there are
several chunks), and the logits matmul is not recomputed (three [N, V, d] matmuls instead of
four). A micro-batch whose logits fit in ``ONE_CHUNK_LOGITS`` is one chunk: dW is then a single
matmul in the compute dtype, rounded once as the reference's, with no fp32 accumulation at all
(see ``default_chunk_rows``). ``fused`` (in
``cross_entropy_triton.py``) is the same loop with the per-chunk softmax/loss/gradient done by
one Triton kernel in place on the logits.

Targets equal to ``IGNORE_INDEX`` (-100, as ``F.cross_entropy``) count neither in the loss nor
in the mean.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from megatrain.kernels import resolve

IGNORE_INDEX = -100

# A chunk's loss and gradient: (logits [C, V], targets [C], scale = 1/n_valid (0-d fp32), need_grad)
# -> (sum of the chunk's per-row losses (0-d fp32), dlogits [C, V] in logits' dtype or None).
# An implementation may overwrite ``logits`` (the fused one writes dlogits in place).
ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def lm_head_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden [N, d], weight [V, d], targets [N] -> mean loss (fp32)."""
    logits = hidden @ weight.t()  # [N, V]
    return F.cross_entropy(logits.float(), targets)


def softmax_cross_entropy_chunk(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                                need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch ChunkFn: logsumexp in fp32; the gradient reuses the fp32 copy in place."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)  # [C]
    valid = targets != IGNORE_INDEX
    safe_targets = torch.where(valid, targets, 0)
    target_logit = lf.gather(1, safe_targets[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
    if not need_grad:
        return loss_sum, None
    probs = lf.sub_(lse[:, None]).exp_()  # softmax, in the fp32 buffer
    rows = torch.arange(len(targets), device=logits.device)
    probs[rows, safe_targets] -= 1.0
    probs.mul_((valid.float() * scale)[:, None])  # ignored rows get zero gradient
    return loss_sum, probs.to(logits.dtype)


# A micro-batch with at most this many logits (8 GiB in bf16) is one chunk. Read at call time.
ONE_CHUNK_LOGITS = 2**32


def default_chunk_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk. The whole micro-batch while its logits fit in ``ONE_CHUNK_LOGITS``: then dW
    is one matmul and nothing is accumulated in fp32. With several chunks each one ends in an fp32
    accumulation of its dW product ([V, d], read and written in fp32: about 1 ms at Llama 3's
    vocabulary on an H200, 8.4 ms per micro-batch of 16 x 2048 tokens of Llama-3.2-1B). One chunk
    of [32768, 128256] is 8 GiB of bf16 logits, overwritten in place by their gradient (Hugging
    Face's loss holds those logits in bf16 and fp32 at once). Measured in that model's training
    step on an H200 (benchmarks/mfu.py, batch 64): 70,393 tokens/s in one chunk against 69,580 in
    4096-row chunks, peak memory 68.7 against 62.9 GiB.

    Larger micro-batches: the largest power of two with at most 2^28 logits (512 MB in bf16),
    i.e. 4096 x 50304 at 1.3B shapes. Measured on an H200 (16384 tokens, fused): 4096-row chunks
    take 17.8 ms and 1.30 GB, 2048-row chunks 19.6 ms and 1.10 GB; the difference is mostly the
    per-chunk fp32 accumulation of dW (see ``_accumulate_fp32``)."""
    if n_rows * vocab <= ONE_CHUNK_LOGITS:
        return max(1, n_rows)
    rows = 1
    while rows * 2 * vocab <= 2**28:
        rows *= 2
    # Large vocabularies: 4096 rows while a chunk stays under 2^30 logits. At Llama 3's 128256 the
    # 2^28 budget alone gives 2048-row chunks, whose fp32 dW accumulations ([V, d] each, ~1 ms on
    # an H200) were 3.4% of a Llama-3.2-1B training step (benchmarks/mfu.py profile); a 4096-row
    # chunk is 1 GB of bf16 logits there.
    rows = max(rows, min(4096, 2**30 // vocab))
    return max(1, min(n_rows, rows))


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc (fp32) += a @ b. A bf16 product is rounded to bf16 once per chunk, then added in fp32:
    no worse than the reference's single bf16 product for the whole batch. The mixed-dtype add
    costs about 0.4 ms per chunk at [50304, 2048] on an H200, hence few, large chunks. (cuBLAS
    writing the bf16 product straight into fp32, ``torch.addmm(..., out_dtype=torch.float32)``,
    measured slower there: 19.3 vs 18.7 ms for the whole loss with 2048-row chunks.)"""
    if a.dtype == torch.float32:
        return acc.addmm_(a, b)
    return acc.add_(a @ b)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What the matmuls run in: the autocast dtype when autocast is on (as the reference's
    ``hidden @ weight.t()`` would), else the promoted input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.result_type(hidden, weight)


class _ChunkedLMHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                chunk_fn: ChunkFn, need_grad: bool, compute_dtype: torch.dtype) -> torch.Tensor:
        need_dh = need_grad and ctx.needs_input_grad[0]
        need_dw = need_grad and ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            n_valid = (targets != IGNORE_INDEX).sum()
            scale = 1.0 / n_valid.float()  # no host sync: stays on the device
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            dh = torch.empty_like(h) if need_dh else None
            one_chunk = 0 < h.shape[0] <= chunk_rows  # dW is then one matmul, rounded once (no fp32 sum)
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_dw and not one_chunk else None
            for start in range(0, h.shape[0], chunk_rows):
                h_c = h[start:start + chunk_rows]
                logits = h_c @ w.t()
                loss_c, dlogits = chunk_fn(logits, targets[start:start + chunk_rows], scale, need_dh or need_dw)
                loss += loss_c
                if dh is not None:
                    torch.mm(dlogits, w, out=dh[start:start + chunk_rows])
                if need_dw and one_chunk:
                    dw = dlogits.t() @ h_c  # [V, d] in the compute dtype
                elif need_dw:
                    dw = _accumulate_fp32(dw, dlogits.t(), h_c)
                del logits, dlogits  # free this chunk before the next one is allocated
        ctx.save_for_backward(dh, dw)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dh, dw = ctx.saved_tensors
        # Out of place: the saved gradients must survive a second backward (retain_graph).
        grad_hidden = (dh * grad_loss.to(dh.dtype)).to(ctx.hidden_dtype) if dh is not None else None
        grad_weight = (dw * grad_loss).to(ctx.weight_dtype) if dw is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def lm_head_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                  chunk_rows: int | None = None,
                                  chunk_fn: ChunkFn = softmax_cross_entropy_chunk) -> torch.Tensor:
    """Same contract as the reference, computed chunk by chunk (works on CPU and GPU)."""
    rows = chunk_rows or default_chunk_rows(hidden.shape[0], weight.shape[0])
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedLMHeadCE.apply(hidden, weight, targets, rows, chunk_fn, need_grad,
                                  _compute_dtype(hidden, weight))


def lm_head_cross_entropy_fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                chunk_rows: int | None = None) -> torch.Tensor:
    """The chunked loop with each chunk's softmax, loss and gradient in one Triton kernel (GPU)."""
    from megatrain.kernels.cross_entropy_triton import softmax_cross_entropy_chunk_triton

    chunk_fn = functools.partial(softmax_cross_entropy_chunk_triton, ignore_index=IGNORE_INDEX)
    return lm_head_cross_entropy_chunked(hidden, weight, targets.contiguous(), chunk_rows, chunk_fn=chunk_fn)


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    choice = resolve(impl, hidden, under_compile=None)
    if choice == "fused":
        return lm_head_cross_entropy_fused(hidden, weight, targets)
    if choice == "chunked":
        return lm_head_cross_entropy_chunked(hidden, weight, targets)
    return lm_head_cross_entropy_reference(hidden, weight, targets)
