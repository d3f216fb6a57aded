"""Transformer blocks: MegaScale's parallel block and the classic serial pre-LN block.

Each block has ``enter``/``exit`` slots (identity here). Tensor + sequence parallelism replaces
them from outside with all-gather / reduce-scatter regions; the parallel block needs one of each
per layer because attention and MLP read the same normalised input and their outputs are summed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.model.layers import MLP, Attention, LayerNorm


class ParallelBlock(nn.Module):
    """y = x + attn(ln(x)) + mlp(ln(x)): one LayerNorm, attention and MLP side by side."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = LayerNorm(cfg.d_model, cfg)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.enter = nn.Identity()
        self.exit = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        h = self.enter(self.ln(x))
        return x + self.exit(self.attn(h) + self.mlp(h))


class SerialBlock(nn.Module):
    """x = x + attn(ln1(x)); x = x + mlp(ln2(x)) (GPT-2 / nanoGPT pre-LN)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = LayerNorm(cfg.d_model, cfg)
        self.attn = Attention(cfg)
        self.ln2 = LayerNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg)
        self.enter_attn, self.exit_attn = nn.Identity(), nn.Identity()
        self.enter_mlp, self.exit_mlp = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        x = x + self.exit_attn(self.attn(self.enter_attn(self.ln1(x))))
        return x + self.exit_mlp(self.mlp(self.enter_mlp(self.ln2(x))))


def make_block(cfg: ModelConfig) -> nn.Module:
    return ParallelBlock(cfg) if cfg.block == "parallel" else SerialBlock(cfg)
