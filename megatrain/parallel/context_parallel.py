"""Context parallelism (``parallel.cp``): each sample's tokens split over the cp ranks of a group.

What is sharded: the activations along the sequence. Every cp rank of a data-parallel group gets
the same samples from the loader and keeps two chunks of each: the sequence is cut into 2 cp equal
chunks and cp rank r keeps chunks r and 2 cp - 1 - r (``shard_batch``: inputs, targets, and the
global positions of those tokens for RoPE or the learned table). Under causal attention chunk i
costs about i, so pairing an early chunk with a late one gives every rank the same work. Document
ids (``model.attention_mask: document``) are computed on the whole sample before the cut, so
they are global.

What crosses the network: only inside attention (``Sequence.attend``, set per micro-batch):
- ``ring`` (``ring_attention.py``): the K/V blocks (and their document ids) go around the ring,
  cp - 1 sends per layer forward, their gradients travel back the same way;
- ``alltoall`` (Ulysses): q, k, v are exchanged by all-to-all from sequence-sharded [B, H, T/cp]
  to head-sharded [B, H/cp, T], attention runs on the whole sequence for H/cp heads, and the
  output returns by the inverse all-to-all (its backward is that inverse too). Needs heads and
  KV heads divisible by cp (``Config`` refuses others, naming the field).

MoE layers (``apply_context_parallel_moe``): routing and experts are per token, so they need
nothing, but the balance loss's expert shares are those of the whole micro-batch: its slot counts
are summed over the cp group (``MoE.token_group``). Expert parallelism is carved out of the dp x cp
replicas (``dims.py``).

Parameters are replicated over cp: the gradients are reduced over the dp x cp replica group
(``ProcessGroups.replicas()``, ZeRO's data-parallel group). Each rank's loss is the mean over its
own tokens, reweighted (``loss_weight``) so that averaging over the replicas gives the mean over
all tokens of the sample even when ignored targets fall unevenly on the chunks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatrain.kernels.attention import causal_attention, document_ids
from megatrain.kernels.cross_entropy import IGNORE_INDEX
from megatrain.model.moe import moe_layers
from megatrain.model.sequence import Sequence
from megatrain.parallel.ring_attention import chunk_ids, ring_attention


def chunk_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """[2 seq_len / (2 cp)] int64: the global positions of cp rank ``cp_rank``'s tokens, its two chunks in order."""
    if seq_len % (2 * cp):
        raise ValueError(f"parallel.cp ({cp}): the sequence length ({seq_len}) must be divisible by 2 * cp")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, cp_rank)])


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp: int, cp_rank: int, eos_id: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Whole samples [B, T] -> this cp rank's (inputs, targets, positions [T/cp], doc_ids [B, T/cp] or None).
    ``eos_id`` given: the document ids, from the whole sample's inputs."""
    positions = chunk_positions(inputs.shape[1], cp, cp_rank, inputs.device)
    docs = None if eos_id is None else document_ids(inputs, eos_id)[:, positions]
    return inputs[:, positions], targets[:, positions], positions, docs


def apply_context_parallel_moe(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Every MoE layer's balance loss counts the routed slots of the whole samples (the cp group's)."""
    for layer in moe_layers(model):
        layer.token_group = group


def loss_weight(targets: torch.Tensor, local_targets: torch.Tensor, cp: int) -> float:
    """The factor on this rank's mean loss so that the mean over the cp ranks is the mean over all
    counted tokens of the samples: cp * local count / whole count (1 when nothing is ignored)."""
    whole = int((targets != IGNORE_INDEX).sum())
    local = int((local_targets != IGNORE_INDEX).sum())
    return cp * local / whole if whole else 0.0


# ---- Ulysses: all-to-all between sequence and heads -------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """x [cp, ...]: slice j goes to cp rank j; returns [cp, ...] with slice j from rank j. The
    exchange is its own inverse, so the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()  # the exchange reads and writes dense slices
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """[T]: the global positions of the tokens as the all-to-all stacks them (rank 0's, rank 1's, ...)."""
    return torch.cat([chunk_positions(seq_len, cp, j, device) for j in range(cp)])


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, N, T/cp, hd] (this rank's tokens, all heads) -> [B, N/cp, T, hd] (every token in global order, head group r)."""
    cp = dist.get_world_size(group)
    B, N, Tl, hd = x.shape
    parts = _AllToAll.apply(x.reshape(B, cp, N // cp, Tl, hd).transpose(0, 1), group)  # [cp, B, N/cp, Tl, hd]
    stacked = parts.permute(1, 2, 0, 3, 4).reshape(B, N // cp, cp * Tl, hd)  # tokens in rank order
    order = _order(cp * Tl, cp, x.device)
    return stacked[:, :, torch.argsort(order)]


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse: [B, N/cp, T, hd] -> [B, N, T/cp, hd]."""
    cp = dist.get_world_size(group)
    B, n, T, hd = y.shape
    stacked = y[:, :, _order(T, cp, y.device)].reshape(B, n, cp, T // cp, hd).permute(2, 0, 1, 3, 4)
    parts = _AllToAll.apply(stacked, group)  # [cp, B, N/cp, Tl, hd]: head group j from rank j
    return parts.transpose(0, 1).reshape(B, cp * n, T // cp, hd)


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                       doc_ids: torch.Tensor | None, group: dist.ProcessGroup, impl: str = "auto") -> torch.Tensor:
    """q [B, H, T/cp, hd], k, v [B, G, T/cp, hd] -> [B, H, T/cp, hd]: whole-sequence attention on H/cp heads."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"parallel.cp_mode=alltoall: {q.shape[1]} heads and {k.shape[1]} KV heads per rank must be "
                         f"divisible by parallel.cp ({cp})")
    full_docs = None
    if doc_ids is not None:  # ids of every token, in global order (no gradient: a plain all-gather)
        gathered = [torch.empty_like(doc_ids) for _ in range(cp)]
        dist.all_gather(gathered, doc_ids.contiguous(), group=group)
        full_docs = torch.cat(gathered, 1)[:, torch.argsort(_order(doc_ids.shape[1] * cp, cp, doc_ids.device))]
    y = causal_attention(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group), window, impl, full_docs)
    return heads_to_seq(y, group)


def make_attend(mode: str, group: dist.ProcessGroup, impl: str = "auto") -> Callable:
    """The ``Sequence.attend`` of a cp rank: (q, k, v, window, doc_ids) -> y."""
    if mode == "ring":
        return lambda q, k, v, window, doc_ids: ring_attention(q, k, v, window, doc_ids, group)
    if mode == "alltoall":
        return lambda q, k, v, window, doc_ids: alltoall_attention(q, k, v, window, doc_ids, group, impl)
    raise ValueError(f"parallel.cp_mode: {mode!r} is not one of ring, alltoall")


def cp_sequence(positions: torch.Tensor, doc_ids: torch.Tensor | None, mode: str,
                group: dist.ProcessGroup, impl: str = "auto") -> Sequence:
    """What the model's attention layers need for one micro-batch on a cp rank."""
    return Sequence(positions=positions, doc_ids=doc_ids, attend=make_attend(mode, group, impl))


def rank_chunks(inputs: torch.Tensor, targets: torch.Tensor, cfg, groups, eos_id: int | None):
    """Whole samples -> (inputs, targets, sequence, loss weight) of this cp rank: its two chunks,
    the ``Sequence`` its attention layers read (global positions, document ids of the whole samples
    under ``model.attention_mask: document``, the ring or all-to-all) and its loss weight. What the
    trainer's forward and the held-out loss both run on. cfg: the run's ``Config``; groups: its
    ``ProcessGroups`` (with cp > 1)."""
    cp = groups.dims.cp
    eos = eos_id if cfg.model.attention_mask == "document" else None
    x, y, positions, docs = shard_batch(inputs, targets, cp, groups.cp_rank, eos)
    sequence = cp_sequence(positions, docs, cfg.parallel.cp_mode, groups.cp_group, cfg.model.kernels.attention)
    return x, y, sequence, loss_weight(targets, y, cp)
