"""RMSNorm (Zhang & Sennrich 2019; Llama): y = x / sqrt(mean(x^2) + eps) * weight.

The reference normalises in fp32 and rounds to the input dtype before the gain, as Llama and
Hugging Face's ``LlamaRMSNorm`` do. ``add_rms_norm`` fuses the residual add before a serial
block's second norm: ``s = x + residual; return rms_norm(s), s``; the Triton kernel
(``rmsnorm_triton.py``) reads x and residual once and writes s and y in one pass, and its
backward adds the gradient arriving through s.
"""

from __future__ import annotations

import torch

from megatrain.kernels import resolve


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 for 16-bit inputs
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    if resolve(impl, x) == "fused":
        from megatrain.kernels.rmsnorm_triton import rms_norm_fused

        return rms_norm_fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if resolve(impl, x) == "fused":
        from megatrain.kernels.rmsnorm_triton import add_rms_norm_fused

        return add_rms_norm_fused(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_with_skip(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x), x)`` for a norm with a skip connection around it (a serial block's first
    norm: ``h, x = rms_norm_with_skip(x); x = x + attn(h)``). The Triton version's backward adds
    the skip's gradient while it writes the norm's, so it runs under torch.compile too (``auto``
    there means Triton on CUDA): inductor would otherwise sum the two gradients on its own."""
    if resolve(impl, x, under_compile=None) == "fused":
        from megatrain.kernels.rmsnorm_triton import rms_norm_with_skip_fused

        return rms_norm_with_skip_fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps), x
