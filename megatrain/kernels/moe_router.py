"""The MoE router's selection (``model/moe.py``): each token's top-k experts by score + bias, and
how many slots each expert got. The reference is torch's ``topk`` and a ``scatter_add_`` of ones;
the Triton pair (``moe_router_triton.py``) does both in registers. Neither carries a gradient:
the router's weights come from ``scores.gather(experts)``, which autograd differentiates.
"""

from __future__ import annotations

import torch

from megatrain.kernels import resolve


def topk_reference(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    return (scores + bias).topk(k, dim=-1).indices  # [N, k]


def counts_reference(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def topk_experts(scores: torch.Tensor, bias: torch.Tensor, k: int, impl: str = "auto") -> torch.Tensor:
    """scores [N, E], bias [E] -> [N, k] int64 ids of each row's k largest scores + bias, best first."""
    with torch.no_grad():  # ids only: the gradient reaches the scores through the gathered weights
        if resolve(impl, scores, under_compile=None) == "fused":
            from megatrain.kernels.moe_router_triton import topk_fused

            return topk_fused(scores, bias, k)
        return topk_reference(scores, bias, k)


def expert_counts(experts: torch.Tensor, n_experts: int, impl: str = "auto") -> torch.Tensor:
    """experts [N, k] int64 ids -> [n_experts] int64: the slots routed to each expert."""
    if resolve(impl, experts, under_compile=None) == "fused":
        from megatrain.kernels.moe_router_triton import counts_fused

        return counts_fused(experts, n_experts)
    return counts_reference(experts, n_experts)
