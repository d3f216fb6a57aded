"""Causal self-attention, full or sliding-window, multi-head or grouped-query.

Convention: with window ``w``, query ``i`` attends to keys ``j`` with ``i - w < j <= i`` (itself
and the ``w - 1`` tokens before it), so ``w >= seq_len`` is exactly full causal attention.

Grouped-query attention (GQA): k and v may carry fewer heads than q ([B, H_kv, T, hd] with
H % H_kv == 0); query head h reads key/value head h // (H / H_kv), as Llama's ``repeat_kv`` and
SDPA's ``enable_gqa``. The reference repeats k and v explicitly; SDPA and FlexAttention read the
shared heads without copying them.
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


def repeat_kv(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, H_kv, T, hd] -> [B, H, T, hd]: each KV head repeated for its H / H_kv query heads."""
    return kv.repeat_interleave(n_head // kv.shape[1], dim=1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                        offset: int = 0) -> torch.Tensor:
    """Explicit softmax(QK^T / sqrt(d)) V. q: [B, H, T, hd]; k, v: [B, H_kv, offset + T, hd] -> [B, H, T, hd]."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [B, H, T, offset + T]
    mask = sliding_window_mask(q.shape[-2], window, q.device, offset, k.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return probs.to(q.dtype) @ v


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """SDPA: the flash/cuDNN kernel for full causal; a boolean mask for windows (CPU, short seqs)."""
    seq_len, gqa = q.shape[-2], k.shape[1] != q.shape[1]
    if window is None or window >= seq_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = sliding_window_mask(seq_len, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attention_at_offset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None = None) -> torch.Tensor:
    """Decoding with a KV cache: q [B, H, T, hd] are the queries at positions offset .. offset + T - 1,
    k, v [B, H_kv, offset + T, hd] every key so far. SDPA with an explicit mask (generation, not training)."""
    mask = sliding_window_mask(q.shape[-2], window, q.device, offset, k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, impl: str = "auto") -> torch.Tensor:
    """q [B, H, T, hd], k, v [B, H_kv, T, hd] -> [B, H, T, hd]. ``impl``: auto, sdpa, flex or reference.

    A real window (w < T) on CUDA runs FlexAttention (``auto`` and ``sdpa`` alike) at training
    lengths, multiples of its 128-token block: SDPA has no sliding-window kernel, and its dense-mask
    path would compute every masked block and hold a [T, T] mask. Other lengths (generation without
    a KV cache grows T one token at a time) take SDPA with the dense mask, which is small there:
    FlexAttention compiles one kernel per length and Inductor fails on some odd ones. Full causal
    runs SDPA (flash/cuDNN) unless ``flex`` is asked for.
    """
    if impl == "reference":
        return attention_reference(q, k, v, window)
    windowed = window is not None and window < q.shape[-2]
    if impl == "flex" or (q.is_cuda and windowed and q.shape[-2] % FLEX_BLOCK == 0):
        from megatrain.kernels.flex_attention import attention_flex

        return attention_flex(q, k, v, window)
    return attention_sdpa(q, k, v, window)
