"""The collectives of tensor + sequence parallelism, as autograd Functions: each one's backward
is the collective its forward's gradient needs (Megatron-LM; Korthikanti et al. 2022).

Regions join the parallel parts of a block to the residual stream; tensor_parallel.py places them
(in the blocks' enter and exit slots, the embedding and the head):

                          forward                       backward
  copy_to_tp              identity                      all-reduce        enter, no SP
  reduce_from_tp          all-reduce                    identity          exit, no SP
  gather_from_sp          all-gather along sequence     reduce-scatter    enter, SP
  reduce_scatter_to_sp    reduce-scatter along seq      all-gather        exit, SP

The vocabulary-parallel cross-entropy reduces the max and the sum-exp of logits sharded over the
vocabulary instead of gathering [N, V] logits. The Functions write their collectives' results in
place, which is why the modules that call them run outside torch.compile (tensor_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.parallel.overlap import all_gather_flat, reduce_scatter_flat

# ---------------------------------------------------------------- collectives along the sequence


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, s, ...] on each rank -> [B, t*s, ...], rank r's shard at positions r*s .. r*s+s-1."""
    world = dist.get_world_size(group)
    buffer = x.new_empty((world * x.shape[0], *x.shape[1:]))  # gloo wants dim 0 = world * B
    all_gather_flat(buffer, x.contiguous(), group)
    return buffer.view(world, *x.shape).transpose(0, 1).reshape(x.shape[0], world * x.shape[1], *x.shape[2:])


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, T, ...] partial sums on each rank -> [B, T/t, ...]: rank r's positions, summed."""
    world = dist.get_world_size(group)
    B, T = x.shape[:2]
    if T % world:
        raise ValueError(f"sequence parallelism: sequence length {T} is not divisible by tp={world}")
    send = x.reshape(B, world, T // world, *x.shape[2:]).transpose(0, 1).flatten(0, 1).contiguous()
    out = x.new_empty(B, T // world, *x.shape[2:])
    reduce_scatter_flat(out, send, group)
    return out


def all_reduced(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over ``group``, in a new tensor (also the TP gradient hook of SP params)."""
    out = x.clone()  # never reduce an autograd input in place
    dist.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------- the regions


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduced(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherFromSP.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group)


# ---------------------------------------------------------------- vocabulary-parallel cross-entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from logits sharded over the vocabulary: [N, V/t] -> [N], fp32.
    loss = log(sum_v exp(z_v - m)) - (z_target - m), with m, the sum and z_target all-reduced."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        ctx.dtype = logits.dtype
        logits = logits.float()
        global_max = logits.max(dim=-1).values
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)  # a constant: it cancels out
        shifted = logits - global_max.unsqueeze(-1)
        local_targets = targets - vocab_start
        outside = (local_targets < 0) | (local_targets >= logits.shape[-1])
        local_targets = local_targets.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both sums
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_targets, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_targets, outside = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d z = softmax - onehot(target), on this rank's columns
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Mean cross-entropy of logits [N, V/t] holding vocabulary rows [vocab_start, +V/t)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group).mean()
