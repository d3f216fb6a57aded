"""LayerNorm: plain torch reference; the fused Triton version lives beside it.

``add_layer_norm`` fuses the residual add that precedes a LayerNorm in a serial (pre-LN) block:
``s = x + residual; return layer_norm(s), s``. The fused kernel reads x and residual once and
writes s and the normalised output in the same pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels import resolve


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, impl: str = "auto") -> torch.Tensor:
    if resolve(impl, x) == "fused":
        from megatrain.kernels.layernorm_triton import layer_norm_fused

        return layer_norm_fused(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def add_layer_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps), summed


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    if resolve(impl, x) == "fused":
        from megatrain.kernels.layernorm_triton import add_layer_norm_fused

        return add_layer_norm_fused(x, residual, weight, bias, eps)
    return add_layer_norm_reference(x, residual, weight, bias, eps)
