"""Positions: a learned table added to the token embedding (GPT-2; ``model.position=learned``,
the table lives in ``gpt.Embedding.wpe``), or rotary embeddings applied to q and k inside every
attention layer (Llama; ``model.position=rope``), implemented here.

RoPE holds no parameters and no buffers: the frequencies are recomputed (fp32) on the device of
the activations at each call. That keeps them exact whatever dtype the module is cast to (a
bf16 buffer would round theta^(-2i/hd) to 3 digits), keeps the state dict equal to Hugging
Face's, and lets the model be built on the meta device. The cost is a [T, hd/2] outer product
per layer, which torch.compile folds into its neighbours.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.rope import rope, rope_inv_freq, rope_tables


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self.impl = cfg.kernels.rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, T, hd], k [B, H_kv, T, hd] at positions offset .. offset + T - 1 -> rotated q, k."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, q.device)  # [hd/2]
        cos, sin = rope_tables(inv_freq, q.shape[-2], offset)  # [T, hd/2] each
        return rope(q, cos, sin, self.impl), rope(k, cos, sin, self.impl)
