"""Causal self-attention, full or sliding-window.

Convention: with window ``w``, query ``i`` attends to keys ``j`` with ``i - w < j <= i`` (itself
and the ``w - 1`` tokens before it), so ``w >= seq_len`` is exactly full causal attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sliding_window_mask(seq_len: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend to key j."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Explicit softmax(QK^T / sqrt(d)) V. q, k, v: [B, H, T, hd] -> [B, H, T, hd]."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    mask = sliding_window_mask(q.shape[-2], window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return probs.to(q.dtype) @ v


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """SDPA: the flash/cuDNN kernel for full causal; a boolean mask for windows (CPU, short seqs)."""
    seq_len = q.shape[-2]
    if window is None or window >= seq_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = sliding_window_mask(seq_len, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None, impl: str = "auto") -> torch.Tensor:
    """q, k, v: [B, H, T, hd] -> [B, H, T, hd]. ``impl``: auto, sdpa, flex or reference.

    A real window (w < T) on CUDA always runs FlexAttention (``auto`` and ``sdpa`` alike): SDPA
    has no sliding-window kernel, and its dense-mask path would compute every masked block and
    hold a [T, T] mask. Full causal runs SDPA (flash/cuDNN) unless ``flex`` is asked for.
    """
    if impl == "reference":
        return attention_reference(q, k, v, window)
    windowed = window is not None and window < q.shape[-2]
    if impl == "flex" or (q.is_cuda and windowed):
        from megatrain.kernels.flex_attention import attention_flex

        return attention_flex(q, k, v, window)
    return attention_sdpa(q, k, v, window)
