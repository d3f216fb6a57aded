"""Tensor + sequence parallelism (Megatron-LM; Korthikanti et al. 2022), applied in place to a
plain GPT by ``apply_tensor_parallel``.

Inside a TP group of t ranks:
- attention ``qkv`` and MLP ``fc`` are column-parallel: each rank holds 1/t of the heads and of
  the hidden units, so attention and GeLU run locally;
- attention ``proj`` and MLP ``proj`` are row-parallel: each rank multiplies its 1/t of the input
  features and leaves a partial sum; the block's exit region adds the partial sums, then the bias;
- the token embedding and the (tied) LM head are vocabulary-parallel: each rank holds V/t rows,
  and the cross-entropy reduces max and sum-exp over the group instead of gathering logits.

Regions join the parallel parts to the residual stream: on entry a block's input becomes whole
on every rank, on exit the partial sums are reduced (the autograd Functions of tp_collectives.py:
all-reduces without sequence parallelism, all-gather / reduce-scatter along the sequence with it).

With sequence parallelism (SP) the residual stream between blocks is split along the sequence:
LayerNorms and residual adds run on T/t tokens per rank and stored activations shrink by t. The
embedding's partial sums are reduce-scattered straight into that layout and the head gathers it
back. Every parameter that is not sharded (LayerNorm gains and biases, row-parallel biases, the
position table) then sees only its shard's tokens: each is marked ``sequence_parallel = True``
and a gradient hook all-reduces its gradient over the TP group as autograd produces it, before
DeepSpeed's ZeRO hooks (which reduce over DP) or the optimizer see it. The parallel block's
attention and MLP read one gathered input and their partial outputs are summed before one
reduce-scatter: one all-gather and one reduce-scatter per layer (the serial block needs two each).

Sharded parameters carry ``tensor_model_parallel = True`` (DeepSpeed then counts them on every
TP rank in the global gradient norm, replicated ones only on TP rank 0) plus ``partition_dim`` and
``partition_interleave`` (a count of equal fused blocks, or their sizes for a grouped-query qkv),
which ``full_tensor`` uses to reassemble the whole tensor. Rule for grouped-query attention: KV
heads are sharded like query heads (tp must divide n_kv_head; the config refuses otherwise), so a
rank's query heads find their KV heads on the same rank and no KV head is replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatrain.config import OverlapConfig
from megatrain.model.block import ParallelBlock, SerialBlock
from megatrain.model.gpt import GPT, Head
from megatrain.parallel.dims import ProcessGroups
from megatrain.parallel.overlap import all_gather_flat, all_gather_matmul, matmul_reduce_scatter
from megatrain.parallel.tp_collectives import (
    all_reduced,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy,
)

# Tensor-parallel modules run outside torch.compile: dynamo leaves them to eager PyTorch and compiles
# the code between them (attention core, GeLU, LayerNorm). The regions' autograd Functions
# (tp_collectives.py) write their collectives' results in place (``dist.all_reduce(out)``,
# ``all_gather_into_tensor(buffer)``), and torch 2.11 (the GPU image) routes the gradient of an
# autograd.Function whose forward mutates its output in place to the wrong output slot when it is
# traced by dynamo: zero gradients, no error (pytorch/pytorch#180642, fixed in 2.12). Traced inside
# the compiled blocks, every TP2 run of the 1.3B model on two H200s had a first gradient norm of 3.2
# against 41.9 for the same batch on one GPU, a backward pass shorter than the forward, and a loss
# that did not fall (benchmarks/RESULTS.md). The column/row-parallel linears stay eager too: they
# hand tensors to the regions through module attributes (``accept_precomputed``,
# ``reduced_output``) and identity checks, which dynamo would turn into guards.
_eager = torch.compiler.disable


# ---------------------------------------------------------------- layers


Interleave = int | tuple[int, ...]


def _blocks(tensor: torch.Tensor, dim: int, interleave: Interleave, world: int = 1) -> tuple[torch.Tensor, ...]:
    """``tensor`` cut into its fused blocks: ``interleave`` equal ones (an int), or blocks of the
    given whole-tensor sizes (a tuple), each divided by ``world`` when ``tensor`` is one shard."""
    if isinstance(interleave, int):
        return tensor.chunk(interleave, dim)
    return tensor.split([size // world for size in interleave], dim)


def _shard(tensor: torch.Tensor, dim: int, rank: int, world: int, interleave: Interleave = 1) -> torch.Tensor:
    """This rank's 1/world of ``tensor`` along ``dim``. ``interleave`` treats the dim as fused
    blocks and slices each: 3 for GPT's equal q, k, v; (H hd, G hd, G hd) for a grouped-query qkv
    (rank r holds q_r, k_r, v_r: H/t query heads and the G/t KV heads they read, the layout
    Attention's split expects); 2 for SwiGLU's [gate | up]."""
    blocks = _blocks(tensor.detach(), dim, interleave)
    return torch.cat([block.chunk(world, dim)[rank] for block in blocks], dim).clone()


def _mark_sharded(param: nn.Parameter, dim: int, interleave: Interleave = 1) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_interleave = interleave
    return param


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's slice of the output features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, interleave: Interleave = 1):
        super().__init__()
        self.weight = _mark_sharded(nn.Parameter(weight), 0, interleave)
        self.bias = _mark_sharded(nn.Parameter(bias), 0, interleave) if bias is not None else None
        self._precomputed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world: int, interleave: Interleave = 1) -> ColumnParallelLinear:
        bias = _shard(linear.bias, 0, rank, world, interleave) if linear.bias is not None else None
        return cls(_shard(linear.weight, 0, rank, world, interleave), bias, interleave)

    def accept_precomputed(self, x: torch.Tensor, x_times_weight: torch.Tensor) -> None:
        """The enter region already computed x @ W^T while gathering x (overlap.py); the next
        call with this very tensor returns it instead of multiplying again."""
        self._precomputed = (x, x_times_weight)

    @_eager
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precomputed, self._precomputed = self._precomputed, None
        if precomputed is not None and precomputed[0] is x:
            out = precomputed[1]
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """partial_r = x_r W_r^T over this rank's slice of the input features. The sum over ranks,
    and the bias after it (exactly once), are the exit region's job."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = _mark_sharded(nn.Parameter(weight), 1)
        self.bias = nn.Parameter(bias) if bias is not None else None  # whole, replicated
        self._fused: tuple[dist.ProcessGroup, int] | None = None
        self.reduced_output: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world: int) -> RowParallelLinear:
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(_shard(linear.weight, 1, rank, world), bias)

    def fuse_reduce_scatter(self, group: dist.ProcessGroup, chunks: int) -> None:
        """Run the GEMM pipelined with the exit's reduce-scatter (overlap.py). Only for a linear
        whose output goes straight into its exit region (the serial block's projections)."""
        self._fused = (group, chunks)

    @_eager
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is None:
            return F.linear(x, self.weight)
        self.reduced_output = matmul_reduce_scatter(x, self.weight, *self._fused)
        return self.reduced_output


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/t) of the token table; other tokens give zeros here and
    their vectors arrive from the rank that holds them in the reduction."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup, sequence_parallel: bool):
        super().__init__()
        self.weight = _mark_sharded(nn.Parameter(weight), 0)
        self.vocab_start = vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, d], or [B, T/t, d] with SP
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(partial, self.group)
        return reduce_from_tensor_parallel(partial, self.group)


class SequenceShardPositionEmbedding(nn.Module):
    """The whole position table (replicated), returning the rows of this rank's sequence shard,
    so it adds to the token embedding's [B, T/t, d] output under SP."""

    def __init__(self, weight: torch.Tensor, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.rank, self.world = rank, world

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T/t, d]
        return F.embedding(positions.reshape(self.world, -1)[self.rank], self.weight)


# ---------------------------------------------------------------- the block's regions


class EnterRegion(nn.Module):
    """Fills a block's enter slot: the normalised input becomes whole on every TP rank. With SP
    and ``chunks > 1`` the all-gather is pipelined with the GEMMs of the ``consumers`` (the
    column-parallel linears that read this input through their forward)."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool, consumers: list[ColumnParallelLinear], chunks: int):
        super().__init__()
        self.group, self.sequence_parallel, self.chunks = group, sequence_parallel, chunks
        self._consumers = list(consumers)  # a plain list: they stay registered where they live

    @_eager
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return copy_to_tensor_parallel(h, self.group)
        if self.chunks > 1 and self._consumers:
            full, outs = all_gather_matmul(h, [c.weight for c in self._consumers], self.group, self.chunks)
            for consumer, out in zip(self._consumers, outs):
                consumer.accept_precomputed(full, out)
            return full
        return gather_from_sequence_parallel(h, self.group)


class ExitRegion(nn.Module):
    """Fills a block's exit slot: sums the producers' partial outputs over the TP group (and
    splits them along the sequence with SP), then adds each producer's bias once."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool, producers: list[RowParallelLinear]):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self._producers = list(producers)

    @_eager
    def forward(self, partial: torch.Tensor) -> torch.Tensor:
        fused = [p for p in self._producers if p.reduced_output is partial]
        for producer in self._producers:
            producer.reduced_output = None
        if fused:  # the producer's GEMM already reduce-scattered its output
            out = partial
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel(partial, self.group)
        else:
            out = reduce_from_tensor_parallel(partial, self.group)
        for producer in self._producers:
            if producer.bias is not None:
                out = out + producer.bias
        return out


# ---------------------------------------------------------------- applying it to a GPT


def _patch_head(head: Head, group: dist.ProcessGroup, sequence_parallel: bool, vocab_start: int) -> None:
    """Head.loss -> vocabulary-parallel cross-entropy; Head.forward -> whole logits."""

    def hidden(x: torch.Tensor) -> torch.Tensor:
        h = head.ln_f(x)
        return gather_from_sequence_parallel(h, group) if sequence_parallel else copy_to_tensor_parallel(h, group)

    def loss(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = hidden(x).flatten(0, 1) @ head.projection().t()  # [B*T, V/t]
        return vocab_parallel_cross_entropy(logits, targets.flatten(), vocab_start, group)

    def forward(x: torch.Tensor) -> torch.Tensor:  # logits for evaluation; no gradient through the gather
        local = hidden(x) @ head.projection().t()  # [B, T, V/t]
        world = dist.get_world_size(group)
        shards = local.new_empty((world * local.shape[0], *local.shape[1:]))
        all_gather_flat(shards, local.contiguous(), group)
        return shards.view(world, *local.shape).movedim(0, -2).reshape(*local.shape[:-1], -1)  # [B, T, V]

    head.loss, head.forward = loss, forward


def _all_reduce_grad_over(param: nn.Parameter, group: dist.ProcessGroup) -> None:
    param.sequence_parallel = True
    param.register_hook(lambda grad: all_reduced(grad, group))


def apply_tensor_parallel(model: GPT, groups: ProcessGroups, sequence_parallel: bool, overlap: OverlapConfig) -> GPT:
    """Shard ``model`` over ``groups.tp_group`` in place: slice the existing full weights (so the
    run starts from the same weights as a single process with the same seed), fill the blocks'
    enter/exit slots and switch the head to the vocabulary-parallel loss."""
    cfg, group, rank, world = model.cfg, groups.tp_group, groups.tp_rank, groups.dims.tp
    for what, size in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads), ("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)):
        if size % world:
            raise ValueError(f"tensor parallelism: tp={world} must divide model.{what} ({size})")
    if sequence_parallel and cfg.seq_len % world:
        raise ValueError(f"sequence parallelism: tp={world} must divide model.seq_len ({cfg.seq_len})")
    chunks = overlap.tp_chunks if sequence_parallel else 1

    embed = model.embed
    rows = cfg.vocab_size // world
    embed.wte = VocabParallelEmbedding(_shard(embed.wte.weight, 0, rank, world), rank * rows, group, sequence_parallel)
    if sequence_parallel and embed.wpe is not None:  # RoPE has no table: it rotates the gathered q, k
        embed.wpe = SequenceShardPositionEmbedding(embed.wpe.weight.detach().clone(), rank, world)

    kv_width = cfg.kv_heads * cfg.head_dim
    qkv_blocks = (cfg.n_head * cfg.head_dim, kv_width, kv_width)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, rank, world, interleave=qkv_blocks)
        attn.proj = RowParallelLinear.from_linear(attn.proj, rank, world)
        # MLP calls F.linear(x, fc.weight) itself (its bias goes into the GeLU kernel), so the
        # enter region cannot precompute fc's GEMM: only qkv is a consumer below. SwiGLU's fc
        # holds [gate | up]: each rank takes matching halves of both.
        mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, rank, world, interleave=2 if cfg.mlp == "swiglu" else 1)
        mlp.proj = RowParallelLinear.from_linear(mlp.proj, rank, world)
        if isinstance(block, ParallelBlock):
            # attention and MLP read one gathered input; their partial outputs are summed before
            # the one reduction, so the reduce-scatter cannot be fused with either GEMM alone.
            block.enter = EnterRegion(group, sequence_parallel, [attn.qkv], chunks)
            block.exit = ExitRegion(group, sequence_parallel, [attn.proj, mlp.proj])
        elif isinstance(block, SerialBlock):
            block.enter_attn = EnterRegion(group, sequence_parallel, [attn.qkv], chunks)
            block.exit_attn = ExitRegion(group, sequence_parallel, [attn.proj])
            block.enter_mlp = EnterRegion(group, sequence_parallel, [], chunks)
            block.exit_mlp = ExitRegion(group, sequence_parallel, [mlp.proj])
            if chunks > 1:
                attn.proj.fuse_reduce_scatter(group, chunks)
                mlp.proj.fuse_reduce_scatter(group, chunks)
        else:
            raise TypeError(f"tensor parallelism does not know the block type {type(block).__name__}")

    if model.head.weight is not None:  # an untied head is sharded like the embedding
        model.head.weight = _mark_sharded(nn.Parameter(_shard(model.head.weight, 0, rank, world)), 0)
    _patch_head(model.head, group, sequence_parallel, rank * rows)

    if sequence_parallel:  # every unsharded parameter now sees only its sequence shard
        for param in model.parameters():
            if not getattr(param, "tensor_model_parallel", False):
                _all_reduce_grad_over(param, group)
    return model


def full_tensor(param: nn.Parameter, group: dist.ProcessGroup | None, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor of a TP-sharded parameter (or of ``tensor``, e.g. its gradient, sharded
    the same way); replicated parameters are returned as they are. Collective over ``group``."""
    tensor = param.detach() if tensor is None else tensor.detach()
    if not getattr(param, "tensor_model_parallel", False) or group is None:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return join_shards(shards, param.partition_dim, param.partition_interleave)


def join_shards(shards: list[torch.Tensor], dim: int, interleave: Interleave = 1) -> torch.Tensor:
    """Inverse of ``_shard``: the TP ranks' shards, in rank order -> the whole tensor (also used
    by checkpoint resharding, where ``interleave`` comes back from JSON as a list)."""
    blocks = [_blocks(shard, dim, interleave, len(shards)) for shard in shards]
    count = interleave if isinstance(interleave, int) else len(interleave)
    return torch.cat([torch.cat([b[i] for b in blocks], dim) for i in range(count)], dim)


def shard_tensor(tensor: torch.Tensor, dim: int, rank: int, world: int, interleave: Interleave = 1) -> torch.Tensor:
    """This TP rank's shard of a whole tensor (``_shard``; public for checkpoint resharding)."""
    return _shard(tensor, dim, rank, world, interleave)
