"""Causal self-attention, full or sliding-window, multi-head or grouped-query.

Convention: with window ``w``, query ``i`` attends to keys ``j`` with ``i - w < j <= i`` (itself
and the ``w - 1`` tokens before it), so ``w >= seq_len`` is exactly full causal attention.

Grouped-query attention (GQA): k and v may carry fewer heads than q ([B, H_kv, T, hd] with
H % H_kv == 0); query head h reads key/value head h // (H / H_kv), as Llama's ``repeat_kv`` and
SDPA's ``enable_gqa``. The reference repeats k and v explicitly; SDPA and FlexAttention read the
shared heads without copying them.

Document mask (``model.attention_mask: document``): a packed sample holds several documents, each
ended by EOS; ``doc_ids`` [B, T] numbers them (``document_ids``) and a query attends only to keys of
its own document, on top of causality and the window. Positions (RoPE) are not reset per document.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # FlexAttention's tile: it runs for lengths that are multiples of it


def sliding_window_mask(seq_len: int, window: int | None, device: torch.device | None = None, offset: int = 0,
                        kv_len: int | None = None) -> torch.Tensor:
    """Boolean [T, kv_len] mask, True where query i (at absolute position offset + i) may attend to
    key j. ``offset``/``kv_len`` describe decoding with a KV cache: T new queries after ``offset``
    cached tokens, kv_len = offset + T keys."""
    i = torch.arange(offset, offset + seq_len, device=device)[:, None]
    j = torch.arange(kv_len or seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [B, T] -> [B, T] int32 document index: the token after an EOS starts a new document
    (the EOS itself still belongs to the document it ends). Computed on the whole sample, so the ids
    of a context-parallel chunk are global."""
    eos = (tokens == eos_id).to(torch.int32)
    return (eos.cumsum(-1) - eos).to(torch.int32)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [B, T] -> boolean [B, 1, T, T]: True where query and key lie in the same document."""
    return (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]


def repeat_kv(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, H_kv, T, hd] -> [B, H, T, hd]: each KV head repeated for its H / H_kv query heads."""
    return kv.repeat_interleave(n_head // kv.shape[1], dim=1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                        offset: int = 0, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit softmax(QK^T / sqrt(d)) V. q: [B, H, T, hd]; k, v: [B, H_kv, offset + T, hd] -> [B, H, T, hd].
    ``doc_ids`` [B, T] (offset 0 only): the document mask on top of the causal one."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [B, H, T, offset + T]
    mask = sliding_window_mask(q.shape[-2], window, q.device, offset, k.shape[-2])
    if doc_ids is not None:
        mask = mask & document_mask(doc_ids)  # [B, 1, T, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return probs.to(q.dtype) @ v


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA: the flash/cuDNN kernel for full causal; a boolean mask for windows and documents (CPU, short seqs)."""
    seq_len, gqa = q.shape[-2], k.shape[1] != q.shape[1]
    if doc_ids is None and (window is None or window >= seq_len):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = sliding_window_mask(seq_len, window, q.device)
    if doc_ids is not None:
        mask = mask & document_mask(doc_ids)  # [B, 1, T, T]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attention_at_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None = None) -> torch.Tensor:
    """Decoding with a KV cache: q [B, H, T, hd] are the queries at positions offset .. offset + T - 1,
    k, v [B, H_kv, offset + T, hd] every key so far. SDPA with an explicit mask (generation, not training)."""
    mask = sliding_window_mask(q.shape[-2], window, q.device, offset, k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, impl: str = "auto",
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, T, hd], k, v [B, H_kv, T, hd] -> [B, H, T, hd]. ``impl``: auto, sdpa, flex or reference.
    ``doc_ids`` [B, T]: the document mask (None: one document). On CUDA at multiples of 128 tokens it
    runs FlexAttention with a block mask built from the ids (fully foreign blocks skipped).

    A real window (w < T) on CUDA runs FlexAttention (``auto`` and ``sdpa`` alike) at training
    lengths, multiples of its 128-token block: SDPA has no sliding-window kernel, and its dense-mask
    path would compute every masked block and hold a [T, T] mask. Other lengths (generation without
    a KV cache grows T one token at a time) take SDPA with the dense mask, which is small there:
    FlexAttention compiles one kernel per length and Inductor fails on some odd ones. Full causal
    runs SDPA (flash/cuDNN) unless ``flex`` is asked for.
    """
    if impl == "reference":
        return attention_reference(q, k, v, window, doc_ids=doc_ids)
    masked = doc_ids is not None or (window is not None and window < q.shape[-2])
    if impl == "flex" or (q.is_cuda and masked and q.shape[-2] % FLEX_BLOCK == 0):
        from megatrain.kernels.flex_attention import attention_flex

        return attention_flex(q, k, v, window, doc_ids)
    return attention_sdpa(q, k, v, window, doc_ids)
