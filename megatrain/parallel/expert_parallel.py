"""Expert parallelism (``parallel.ep``), applied from outside to a plain MoE GPT.

The ``ep`` ranks of an EP group (``ProcessGroups.ep_group``: consecutive replicas, the dp x cp
ranks, see ``dims.py``) each hold ``n_experts / ep`` experts of every MoE layer: EP rank r the global ids
``r E_l .. (r + 1) E_l - 1``. Each rank still routes its own tokens (the router and everything
else stay replicated over DP); ``moe.dispatch`` sorts the routed rows by global expert id, so the
rows for EP rank r are one contiguous run, and ``ExpertExchange`` (``MoE.exchange``) does:

1. the per-expert row counts [ep, E_l] are exchanged (``all_to_all_single``): each rank learns how
   many rows every peer sends each of its experts (the split sizes; one host sync);
2. the rows go to their experts' ranks (``all_to_all_single`` with those splits, differentiable:
   the backward sends the gradients back with the splits swapped);
3. the received rows ([source rank][local expert]) are regrouped by local expert, the local
   experts run (any ``Experts`` path), the outputs are put back in the received order;
4. a second all-to-all returns them; ``unpermute`` (``kernels/moe_permute.py``) weights and sums
   them as without EP.

A shared expert (``model.moe.n_shared_experts``) needs no exchange: it runs while the rows of step 2
travel, and in the backward while their gradients travel back (``StartAllToAll`` /
``FinishAllToAll``; ``parallel.overlap.ep_shared_expert``).

Gradients (``attach_expert_grad_sync``): an expert's gradient on a rank already sums the tokens
of the whole EP group. DeepSpeed must not average it over the DP group, whose ranks hold
*different* experts at the same position. A post-accumulate hook moves each expert gradient
aside as it is produced (DeepSpeed then reduces zeros for it); just before the optimizer step it
is summed over the EDP group (the ranks holding the same experts) and divided by the number of
replicas (dp x cp), which is the mean over the global batch, as DeepSpeed's own MoE does. The global norm is exact: the replicated
gradients' squared norm plus the EP group's sum of the experts' squared norms; megatrain clips
with it (DeepSpeed's clipping is off under EP: its norm would count only local experts) and
reports it as DeepSpeed's global norm. LAMB's trust ratio of an expert tensor sums its squared
norms over the EP group, so it is the whole tensor's, as in one process.

What composes (validated in ``config/schema.py``):
- ZeRO stage 0 only. ZeRO 1/2 flatten all parameters into groups partitioned and reduced over the
  one DP group; DeepSpeed's MoE support there needs its own ``deepspeed.moe`` layer classes and
  its expert-group registry, and it averages the expert gradient norms over DP (inexact clipping).
  ZeRO-3 partitions the expert weights over DP as well. Refused with ``parallel.zero_stage``.
- tp 1 and pp 1: the experts have no tensor-parallel form; DeepSpeed's pipeline engine reduces
  gradients itself. Refused naming ``parallel.tp`` / ``parallel.pp``.
- fp32 weights (``train.dtype=fp32``): ZeRO-0 in bf16 is DeepSpeed's FP16_Optimizer, which reduces
  and clips fp32 copies of its own; refused in ``deepspeed.py``.
- Checkpoints: each expert shard records its slice of the layer's experts (``expert_slice``:
  first global id, total), so ``checkpoint/experts.py`` writes one file of experts per (pp, tp,
  ep) from the first rank of each EDP group, and restore at another ep degree joins and re-cuts
  the slices.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from megatrain.kernels.moe_permute import group_order
from megatrain.model.moe import moe_layers
from megatrain.model.moe_experts import Experts
from megatrain.optim.lamb import Lamb, TensorSegments
from megatrain.parallel.dims import ProcessGroups

EXPERT_PARAM = "expert_parallel"  # attribute set on the expert shards (True)
EXPERT_SLICE = "expert_slice"  # (first global expert id, experts of the whole layer) of an expert shard


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, async_op: bool = False):
    """``all_to_all_single`` of rows into a new buffer: (the buffer, the work handle if ``async_op``)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return out, work


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on rows: rank i sends ``in_splits[j]`` rows to rank j and receives
    ``out_splits[j]`` from it. The backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group)[0], None, None, None


class _InFlight:
    """An all-to-all started by ``StartAllToAll`` and finished by ``FinishAllToAll``: its work
    handle in the forward, the gradient's exchange and buffer in the backward."""

    work = None
    grad = None


class StartAllToAll(torch.autograd.Function):
    """``AllToAll`` started without waiting (``async_op``): the returned rows are valid only after
    ``FinishAllToAll``; what runs between the two overlaps the exchange. In the backward the order
    turns around: ``FinishAllToAll.backward`` starts the gradient's exchange, autograd runs the
    nodes recorded between the two (later nodes first), and this one waits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, flight: _InFlight):
        ctx.flight = flight
        out, flight.work = _exchange(x, out_splits, in_splits, group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _passed_through: torch.Tensor):
        ctx.flight.work.wait()
        grad, ctx.flight.grad, ctx.flight.work = ctx.flight.grad, None, None
        return grad, None, None, None, None


class FinishAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, out_splits: list[int], in_splits: list[int], group, flight: _InFlight):
        ctx.splits, ctx.group, ctx.flight = (out_splits, in_splits), group, flight
        flight.work.wait()
        flight.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        ctx.flight.grad, ctx.flight.work = _exchange(grad, in_splits, out_splits, ctx.group, async_op=True)
        return grad, None, None, None, None  # StartAllToAll.backward returns the exchanged one once it arrived


class ExpertExchange:
    """``MoE.exchange`` under expert parallelism: rows sorted by global expert -> the outputs of
    their experts, computed on the ranks that hold them (steps 1-4 of the module docstring).
    ``beside`` (the shared expert) runs while the rows travel, and its gradient while theirs do,
    when ``overlap`` (``parallel.overlap.ep_shared_expert``)."""

    def __init__(self, group, ep: int, n_experts: int, overlap: bool = True):
        self.group, self.ep, self.local, self.overlap = group, ep, n_experts // ep, overlap

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts,
                 beside: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        send = counts.view(self.ep, self.local)  # [peer, its local expert]: rows this rank sends
        recv = torch.empty_like(send)  # [peer, my local expert]: rows each peer sends me
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        both = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # one host sync for both split lists
        in_splits, out_splits = both[0], both[1]
        if beside is not None and self.overlap:
            flight = _InFlight()
            x = StartAllToAll.apply(rows, out_splits, in_splits, self.group, flight)
            beside_out = beside()
            x = FinishAllToAll.apply(x, out_splits, in_splits, self.group, flight)  # [sum(out_splits), d]
        else:
            x = AllToAll.apply(rows, out_splits, in_splits, self.group)
            beside_out = beside() if beside is not None else None
        local_ids = torch.arange(self.local, device=rows.device).repeat(self.ep)  # each (peer, expert) run's expert
        expert_of_row = torch.repeat_interleave(local_ids, recv.flatten())
        order = group_order(expert_of_row, self.local)  # received order -> grouped by local expert
        y = experts(x[order], recv.sum(0))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return AllToAll.apply(y[inverse], in_splits, out_splits, self.group), beside_out  # back to the senders


def is_expert_param(param: torch.Tensor) -> bool:
    return getattr(param, EXPERT_PARAM, False)


def expert_slice(param: torch.Tensor) -> tuple[int, int] | None:
    """(first global expert id, experts of the whole layer) of an expert shard; None otherwise
    (a replicated tensor, or experts held whole)."""
    return getattr(param, EXPERT_SLICE, None)


def apply_expert_parallel(model: nn.Module, groups: ProcessGroups, overlap: bool = True) -> None:
    """Keep this EP rank's slice of every MoE layer's experts (the model was built whole, so the
    slice has the weights one process would hold for those experts) and route through the
    all-to-all. Call after materialization, before precision and activation checkpointing."""
    ep, rank = groups.dims.ep, groups.ep_rank
    for layer in moe_layers(model):
        experts = layer.experts
        n = experts.fc.shape[0]
        if n % ep:
            raise ValueError(f"parallel.ep ({ep}) must divide the experts of layer {layer.layer} ({n})")
        local = n // ep
        first = rank * local
        for name in ("fc", "proj"):
            whole = getattr(experts, name)
            shard = nn.Parameter(whole.detach()[first:first + local].clone(), requires_grad=whole.requires_grad)
            setattr(shard, EXPERT_PARAM, True)
            setattr(shard, EXPERT_SLICE, (first, n))  # where the checkpoint puts (and finds) these experts
            # deepspeed.initialize broadcasts every replicated parameter from DP rank 0, which would give
            # every rank EP rank 0's experts; it skips those marked as per-shard weights (its OptimizedLinear's)
            shard.ds_optim_param = True
            setattr(experts, name, shard)
        experts.first = first
        layer.exchange = ExpertExchange(groups.ep_group, ep, n, overlap)


def _stash(param: torch.Tensor) -> None:
    """Post-accumulate hook: move the expert gradient aside before DeepSpeed averages it over DP."""
    stashed = getattr(param, "_ep_grad", None)
    param._ep_grad = param.grad if stashed is None else stashed.add_(param.grad)
    param.grad = None


def attach_expert_grad_sync(optimizer: torch.optim.Optimizer, model: nn.Module, groups: ProcessGroups,
                            grad_clip: float) -> None:
    """Reduce the experts' gradients over the EDP group, clip by the exact global norm and record
    it, just before each optimizer step (the module docstring). ``optimizer`` is the one that
    steps the model's own parameters (ZeRO stage 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    experts = [p for p in params if is_expert_param(p)]
    dense = [p for p in params if not is_expert_param(p)]
    if not experts:
        raise ValueError("parallel.ep > 1: the model has no expert parameters to spread (apply_expert_parallel first)")
    for p in experts:
        p.register_post_accumulate_grad_hook(_stash)
        if isinstance(optimizer, Lamb):  # the trust ratio of the whole expert tensor: norms summed over EP
            optimizer.set_tensor_segments(p, TensorSegments(spans=[(0, p.shape[0], 0)], num_tensors=1,
                                                            group=groups.ep_group))
    replicas = groups.dims.replicas().dp  # dp x cp: the ranks whose mean gradient a replicated parameter gets

    @torch.no_grad()
    def before_step(opt, args, kwargs) -> None:
        for p in experts:
            grad = p.__dict__.pop("_ep_grad", None)
            grad = torch.zeros_like(p) if grad is None else grad
            if dist.get_world_size(groups.edp_group) > 1:
                dist.all_reduce(grad, group=groups.edp_group)
            p.grad = grad.div_(replicas)
        opt._global_grad_norm = clip_exact(dense, experts, groups, grad_clip)

    optimizer.register_step_pre_hook(before_step)


def global_grad_norm(dense: list[torch.Tensor], experts: list[torch.Tensor], groups: ProcessGroups) -> torch.Tensor:
    """sqrt(|replicated grads|^2 + sum over the EP group of |local expert grads|^2), fp32."""
    def squares(ps: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        grads = [p.grad for p in ps if p.grad is not None]
        if not grads:
            return like.new_zeros((), dtype=torch.float32)
        return torch.stack([g.detach().float().square().sum() for g in grads]).sum()

    anchor = experts[0]
    expert_sq = squares(experts, anchor)
    dist.all_reduce(expert_sq, group=groups.ep_group)
    return (squares(dense, anchor) + expert_sq).sqrt()


def clip_exact(dense: list[torch.Tensor], experts: list[torch.Tensor], groups: ProcessGroups,
               max_norm: float) -> float:
    """Clip every gradient by the global norm (torch's rule: max_norm / (norm + 1e-6) when below
    1); returns the norm before clipping."""
    norm = global_grad_norm(dense, experts, groups)
    value = float(norm)
    if max_norm > 0 and math.isfinite(value):
        coef = max_norm / (value + 1e-6)
        if coef < 1:
            for p in dense + experts:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return value
