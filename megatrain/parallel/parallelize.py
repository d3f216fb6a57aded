"""The one ordered recipe that spreads a plain GPT over ranks:
pipeline split -> tensor/sequence parallel -> activation checkpointing -> compile.
(DeepSpeed, the last step, wraps the result in the trainer.)
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megatrain.config import Config
from megatrain.model.gpt import GPT
from megatrain.parallel.dims import ProcessGroups


class CheckpointedBlock(nn.Module):
    """Recompute a block's activations in the backward pass instead of storing them."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def apply_activation_checkpointing(model: GPT) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = CheckpointedBlock(block)


def parallelize(model: GPT, cfg: Config, groups: ProcessGroups) -> nn.Module:
    if groups.dims.tp > 1:
        from megatrain.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, groups, sequence_parallel=cfg.parallel.sequence_parallel, overlap=cfg.parallel.overlap)
    if cfg.model.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.model.compile:
        for block in model.blocks:
            block.compile()
    return model
