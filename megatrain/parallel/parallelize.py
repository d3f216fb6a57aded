"""The one ordered recipe that spreads a plain GPT over ranks:
tensor/sequence parallel -> materialize (meta-built models) -> expert parallel (this rank's experts)
-> context parallel (MoE balance over the whole samples) -> precision (FP8 linears) -> pipeline split -> activation checkpointing
-> compile.
(DeepSpeed, the last step, wraps the result in the trainer.)

Tensor parallelism comes before the pipeline split because it swaps modules inside the blocks
in place, and the pipeline only references those blocks. Precision swaps the blocks' plain linears for FP8 ones
(``megatrain/precision/``; FP8 with tp > 1 is refused by the config), before anything wraps them. With pp > 1 the result is a DeepSpeed
``PipelineModule`` (train it with ``engine.train_batch``) and activation checkpointing is the
pipeline's own per-stage setting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megatrain.config import Config
from megatrain.model.gpt import GPT
from megatrain.parallel.dims import ProcessGroups
from megatrain.precision import apply_precision


class CheckpointedBlock(nn.Module):
    """Recompute a block's activations in the backward pass instead of storing them."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _recompute_attention(attention: nn.Module) -> None:
    """Selective checkpointing: the attention core (between the qkv and output projections: RoPE,
    softmax(QK^T)V) is recomputed in the backward; the projections, norms and MLP keep their
    activations. The core's stored tensors are what grows with the context (q, k, v rotated, the
    output and its statistics), so this saves most of the long-sequence memory at the cost of one
    attention forward. The method is wrapped on the instance, so parameter names do not change."""
    core = attention.attend  # the bound method: q, k, v -> attention output [B, T, H hd]

    def attend(qkv: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None or not torch.is_grad_enabled():  # generation: nothing to store
            return core(qkv, cache)
        sequence = attention.sequence  # this forward's: a pipeline runs other micro-batches before the recompute

        def recompute(qkv: torch.Tensor) -> torch.Tensor:
            attention.sequence = sequence
            return core(qkv)

        return checkpoint(recompute, qkv, use_reentrant=False)

    attention.attend = attend


def apply_activation_checkpointing(model: GPT, policy: object = "full") -> None:
    """Apply ``model.activation_checkpointing`` (config.model.CheckpointingPolicy, or its name) to
    the blocks: full wraps every block, every_n blocks 0, n, 2n, ..., selective the attention core of
    every block, none nothing."""
    from megatrain.config.model import CheckpointingPolicy

    policy = CheckpointingPolicy.model_validate(policy) if not isinstance(policy, CheckpointingPolicy) else policy
    for i, block in enumerate(model.blocks):
        if policy.recomputed(i):
            model.blocks[i] = CheckpointedBlock(block)
        elif policy.policy == "selective":
            _recompute_attention(block.attn)


# Inductor options for the compiled blocks (``torch.compile(options=...)``), e.g.
# {"coordinate_descent_tuning": True}; None keeps inductor's defaults. A module setting, not a
# config field: benchmarks/mfu.py measures it.
COMPILE_OPTIONS: dict | None = None


def _compile_blocks(model: GPT) -> None:
    for block in model.blocks:
        if COMPILE_OPTIONS:
            block.compile(options=dict(COMPILE_OPTIONS))
        else:
            block.compile()


def parallelize(model: GPT, cfg: Config, groups: ProcessGroups, materialize: Callable[[GPT], object] | None = None) -> nn.Module:
    """``materialize``: for a model built on the meta device, gives this rank's stage and shard
    storage once tensor parallelism has cut the shards, before the pipeline split (``meta.py``)."""
    if groups.dims.tp > 1:
        from megatrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, groups, sequence_parallel=cfg.parallel.sequence_parallel, overlap=cfg.parallel.overlap)
    if materialize is not None:
        materialize(model)
    if groups.dims.ep > 1:  # this rank's slice of the experts, tokens exchanged by all-to-all
        from megatrain.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, groups, overlap=cfg.parallel.overlap.ep_shared_expert)
    if groups.dims.cp > 1:  # the attention's ring or all-to-all is set per micro-batch (Sequence)
        from megatrain.parallel.context_parallel import apply_context_parallel_moe

        apply_context_parallel_moe(model, groups.cp_group)
    apply_precision(model, cfg)
    if groups.dims.pp > 1:
        from megatrain.parallel.pipeline import build_pipeline_module

        policy = cfg.model.activation_checkpointing
        if policy.policy == "every_n":  # DeepSpeed's interval checkpoints runs of n layers, not one in n
            raise ValueError("model.activation_checkpointing every_n with parallel.pp > 1: the pipeline recomputes "
                             "full or selective only")
        if policy.policy == "selective":  # full: the pipeline's own activation_checkpoint_interval
            apply_activation_checkpointing(model, policy)

        if cfg.model.compile:
            _compile_blocks(model)
        return build_pipeline_module(model, cfg, groups)
    if cfg.model.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    if cfg.model.compile:
        _compile_blocks(model)
    return model
