"""LayerNorm: plain torch reference; the fused Triton version lives beside it."""

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
