"""The MoE permutation: tokens to the experts' rows and back (``model/moe.py``'s dispatch and
combine). N tokens each choose k experts, N k slots; slot s is token s // k's (s % k)-th choice;
``order`` [N k] lists the slots grouped by expert (the experts' row r is slot order[r]).

    permute    rows[r] = x[order[r] // k]                               x [N, d] -> [N k, d]
    unpermute  out[n]  = sum_j (w[n, j]) y[row of slot n k + j]         y [N k, d] -> [N, d]

``unpermute``'s weights may be None: a plain sum, for experts that applied the router's weights
themselves (``model/moe.py``). The reference is plain index ops (index_copy back to slot order, a
weighted sum; autograd's backward of the gather is an index_put with accumulate). The Triton
kernels (``moe_permute_triton.py``) walk the tokens, each reading its own row once and writing
every output row once, with fp32 sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatrain.kernels import resolve


def permute_reference(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return x[order // k]  # [N k, d]


def unpermute_reference(y: torch.Tensor, weights: torch.Tensor | None, order: torch.Tensor, k: int) -> torch.Tensor:
    slots = torch.empty_like(y).index_copy(0, order, y).view(-1, k, y.shape[1])  # [N, k, d] slot order (no atomics)
    if weights is not None:
        slots = slots * weights.unsqueeze(-1).to(y.dtype)
    return slots.sum(1)  # [N, d]


def group_order(ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The stable order that groups ``ids`` (values in [0, n_groups)): argsort on keys narrowed to
    the fewest bytes that hold them. CUDA's radix sort makes one pass per key byte: top-k's int64
    expert ids cost 8 passes where uint8 (up to 256 experts) costs 1 (the sort was 0.96 ms of a
    123 ms MoE step on an H100, 136 of its kernels)."""
    narrow = torch.uint8 if n_groups <= 256 else torch.int16 if n_groups <= 2**15 else torch.int32
    return ids.to(narrow).argsort(stable=True)


def row_of_slot(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order``: slot -> its row in expert order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class Slots(NamedTuple):
    """Where the N k routed slots go: ``order`` [N k] lists them grouped by expert (row r of the
    experts' input is slot order[r]), ``row_of_slot`` [N k] is its inverse (what the Triton
    kernels walk the tokens with), k slots a token. Made once per layer, used by both moves."""

    order: torch.Tensor
    row_of_slot: torch.Tensor
    k: int


def group_slots(experts: torch.Tensor, n_experts: int) -> Slots:
    """experts [N, k] (each token's chosen expert ids) -> its Slots."""
    order = group_order(experts.flatten(), n_experts)  # [N k]
    return Slots(order, row_of_slot(order), experts.shape[1])


def permute(x: torch.Tensor, slots: Slots, impl: str = "auto") -> torch.Tensor:
    """x [N, d] -> [N k, d], rows grouped by expert."""
    # fused inside compiled blocks too: inductor's index_put backward adds rows with atomics
    if resolve(impl, x, under_compile=None) == "fused":
        from megatrain.kernels.moe_permute_triton import dispatch_fused

        return dispatch_fused(x, slots.row_of_slot, slots.k)
    return permute_reference(x, slots.order, slots.k)


def unpermute(y: torch.Tensor, weights: torch.Tensor | None, slots: Slots, impl: str = "auto",
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [N k, d] in expert order, weights [N, k] or None -> [N, d]: the (weighted) sum of each
    token's k rows, plus ``residual`` [N, d] if given (the fused kernel adds it in the same pass)."""
    if resolve(impl, y, under_compile=None) == "fused":
        from megatrain.kernels.moe_permute_triton import combine_fused

        return combine_fused(y, weights, slots.row_of_slot, slots.k, residual)
    out = unpermute_reference(y, weights, slots.order, slots.k)
    return out if residual is None else residual + out
