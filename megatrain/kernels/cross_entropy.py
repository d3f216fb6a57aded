"""LM head + cross-entropy. The reference builds the full logits; faster versions avoid
materialising fp32 logits for the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels import resolve


def lm_head_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden [N, d], weight [V, d], targets [N] -> mean loss (fp32)."""
    logits = hidden @ weight.t()  # [N, V]
    return F.cross_entropy(logits.float(), targets)


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    if resolve(impl, hidden) == "fused":
        from megatrain.kernels.cross_entropy_triton import lm_head_cross_entropy_fused

        return lm_head_cross_entropy_fused(hidden, weight, targets)
    return lm_head_cross_entropy_reference(hidden, weight, targets)
