"""Pipeline parallelism: the GPT's flat layer list [Embedding, blocks..., Head] as a DeepSpeed
``PipelineModule``, trained by DeepSpeed's 1F1B schedule (``engine.train_batch``).

Each process builds the whole (tensor-parallel) GPT with the run's seed, so every stage starts
from the single-process weights; ``PipelineModule`` then registers only the layers of this
rank's stage, and the weights of the other stages' layers are released (moved to the meta
device: DeepSpeed keeps a reference to every layer it was given).

Stages are balanced by transformer blocks (``partition_method="type:..."``): the embedding joins
the first stage and the head the last. Activation checkpointing, when the recipe asks for it,
is DeepSpeed's per-stage ``activation_checkpoint_interval=1`` (one block per checkpoint) with
torch's non-reentrant checkpoint; the embedding and head are never recomputed.

Tied embeddings: the head's projection is the token embedding's weight, but the first and the
last stage are different processes. We keep the weight tied through DeepSpeed's
``TiedLayerSpec`` rather than untying it and adding our own all-reduce: DeepSpeed then owns every
part of the contract - it broadcasts the first stage's copy at start, all-reduces the two copies'
gradients between the first and last stage of each (dp, tp) fibre after every backward
(``allreduce_tied_weight_gradients``), and marks the last stage's copy ``ds_pipe_replicated`` so
the global gradient norm counts it once. The tied layer on the last stage only passes hidden
states through; ``Head.loss`` reads the same module's weight.

Context parallelism (``parallel.cp``): DeepSpeed's data axis is the dp x cp replica group (the
topology of ``ParallelDims.replicas()``, in our rank order), so it reduces gradients and averages
the loss over both. A cp rank's tokens are the same two chunks of every micro-batch, so the
stage's layers hold them once (``hold_context_chunks``): the chunks' global positions on the
embedding and on every attention layer, with the ring or all-to-all attention. The trainer and the
evaluator feed the stages the rank's chunks of each micro-batch (``context_parallel.shard_batch``).
The document mask (``model.attention_mask: document``): a micro-batch's document ids change with
every micro-batch, and 1F1B runs several micro-batches' forwards before their backwards (whose
recompute, under activation checkpointing, must see the same ids again). So the ids travel with the
activations: the first stage takes (tokens, doc_ids) (``stage_micro_batch``, computed from the
whole samples before a cp cut), and every layer passes (hidden, doc_ids) on (``EmbedDocuments``,
``BlockWithDocuments``); a block sets its attention layers' ``Sequence`` from the ids it is given,
in its forward and in its recompute. DeepSpeed sends the integer ids between stages and no gradient
for them (it skips tensors that are not floating point).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch.utils.checkpoint import checkpoint

from megatrain.config import Config
from megatrain.model.block import ParallelBlock, SerialBlock
from megatrain.model.gpt import GPT, Embedding, Head
from megatrain.kernels.attention import document_ids
from megatrain.model.attention import Attention
from megatrain.model.sequence import Sequence
from megatrain.parallel.context_parallel import chunk_positions, cp_sequence, shard_batch
from megatrain.parallel.deepspeed import pipeline_topology
from megatrain.parallel.dims import ProcessGroups

BLOCK_TYPES = (ParallelBlock.__name__, SerialBlock.__name__, "BlockWithDocuments")


class _ExistingTiedLayer(TiedLayerSpec):
    """A ``TiedLayerSpec`` for a module that already exists (built and initialised with the
    whole GPT) instead of one DeepSpeed constructs from a class and arguments."""

    def __init__(self, key: str, module: nn.Module, forward_fn=None, tied_weight_attr: str = "weight"):
        super().__init__(key, type(module), forward_fn=forward_fn, tied_weight_attr=tied_weight_attr)
        self.module = module

    def build(self, log: bool = False) -> nn.Module:
        return self.module


class LossHead(nn.Module):
    """The last pipeline layer. It registers the head's own parameters (final LayerNorm, an
    untied projection) on the last stage and passes hidden states through: the loss needs the
    targets, which DeepSpeed hands only to ``loss_fn``."""

    def __init__(self, head: Head):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] if isinstance(x, tuple) else x  # (hidden, doc_ids) under the document mask


class EmbedDocuments(nn.Module):
    """The first layer under the document mask: (tokens [B, T], doc_ids [B, T]) -> (x [B, T, d], doc_ids)."""

    def __init__(self, embed: Embedding):
        super().__init__()
        self.module = embed

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return _embed_documents(self.module, inputs)


class BlockWithDocuments(nn.Module):
    """A block under the document mask: (x, doc_ids) -> (block(x), doc_ids), its attention layers
    reading these ids (with the rank's held context-parallel positions and ring, if any)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block  # named as CheckpointedBlock names it: checkpoint names strip ".block."

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, doc_ids = inputs
        for module in self.block.modules():
            if isinstance(module, Attention):
                held = getattr(module, "held_sequence", None) or Sequence()
                module.sequence = dataclasses.replace(held, doc_ids=doc_ids)
        return self.block(x), doc_ids


def _embed_documents(embed: Embedding, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, doc_ids = inputs
    return embed(tokens), doc_ids


def stage_micro_batch(inputs: torch.Tensor, targets: torch.Tensor, cfg: Config, groups: ProcessGroups,
                      eos_id: int | None) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A micro-batch of whole samples [B, T] -> what the pipeline's first and last stage take: this cp
    rank's chunks of it, and under the document mask (tokens, doc_ids) as the inputs, the ids
    computed on the whole samples (global across the cp chunks)."""
    document = cfg.model.attention_mask == "document"
    if document and eos_id is None:
        raise ValueError("model.attention_mask=document: the data's EOS id is not known to the pipeline")
    if groups.dims.cp == 1:
        x, y, docs = inputs, targets, document_ids(inputs, eos_id) if document else None
    else:
        x, y, _, docs = shard_batch(inputs, targets, groups.dims.cp, groups.cp_rank, eos_id if document else None)
    return ((x, docs) if document else x), y


def _pass_through(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x


def _head_loss(head: Head, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return head.loss(x, targets)


def pipeline_layers(model: GPT) -> list:
    """The layer list DeepSpeed partitions, from ``model.layers()``; under the document mask the
    embedding and the blocks carry the document ids along (module docstring)."""
    embed, *blocks, head = model.layers()
    assert isinstance(embed, Embedding) and isinstance(head, Head), "GPT.layers() must be [Embedding, *blocks, Head]"
    documents = model.cfg.attention_mask == "document"
    if documents:
        blocks = [BlockWithDocuments(block) for block in blocks]
    if not head.tied:
        return [EmbedDocuments(embed) if documents else embed, *blocks, LossHead(head)]
    return [
        _ExistingTiedLayer("embed", embed, forward_fn=_embed_documents if documents else None,
                           tied_weight_attr="wte.weight"),
        *blocks,
        _ExistingTiedLayer("embed", embed, forward_fn=_pass_through, tied_weight_attr="wte.weight"),
        LossHead(head),
    ]


def hold_context_chunks(model: GPT, cfg: Config, groups: ProcessGroups) -> None:
    """A cp rank's layers see its two chunks of every sample: their global positions on the
    embedding (learned positions) and on each attention layer (RoPE), with the cross-rank attention."""
    positions = chunk_positions(cfg.seq_len, groups.dims.cp, groups.cp_rank)
    sequence = cp_sequence(positions, None, cfg.parallel.cp_mode, groups.cp_group, cfg.model.kernels.attention)
    model.embed.positions = positions
    for module in model.modules():
        if isinstance(module, Attention):
            module.sequence = module.held_sequence = sequence  # held: BlockWithDocuments adds the ids


def build_pipeline_module(model: GPT, cfg: Config, groups: ProcessGroups) -> PipelineModule:
    """Wrap a (possibly tensor-parallel) GPT as this rank's pipeline stage. Every rank must call
    it (PipelineModule creates process groups). Train the result with ``deepspeed.initialize(
    model=pipe, mpu=None, config=deepspeed_config(...))`` and ``engine.train_batch(batches)``,
    where ``batches`` yields (inputs, targets) micro-batches."""
    dims = groups.dims
    if cfg.model.tie_embeddings and groups.pp_rank == dims.pp - 1 and dims.pp > 1 and model.embed.wpe is not None:
        # The last stage holds the whole Embedding for its tied token table; its position table
        # is never used there and must not be trained (it would get no gradient).
        model.embed.wpe.weight.requires_grad_(False)
    if dims.cp > 1:
        hold_context_chunks(model, cfg, groups)
    layers = pipeline_layers(model)
    pipe = PipelineModule(
        layers=layers,
        topology=pipeline_topology(dims.replicas()),  # DeepSpeed's data axis: the dp x cp replicas
        loss_fn=partial(_head_loss, model.head),
        partition_method="type:" + "|".join(BLOCK_TYPES),
        activation_checkpoint_interval=1 if cfg.model.activation_checkpointing.policy == "full" else 0,
        activation_checkpoint_func=partial(checkpoint, use_reentrant=False),
        checkpointable_layers=list(BLOCK_TYPES),
    )
    on_this_stage = {id(module) for module in pipe.modules()}
    for layer in layers:
        module = layer.module if isinstance(layer, (_ExistingTiedLayer, EmbedDocuments)) else layer
        if id(module) not in on_this_stage:
            module.to("meta")
    return pipe
