"""Positions: a learned table added to the token embedding (GPT-2; ``model.position=learned``,
the table lives in ``gpt.Embedding.wpe``), or rotary embeddings applied to q and k inside every
attention layer (Llama; ``model.position=rope``), implemented here.

RoPE holds no parameters. Its cos/sin tables for positions 0 .. seq_len - 1 ([seq_len, hd/2],
fp32) are non-persistent buffers: not in the state dict (which stays equal to Hugging Face's),
moved with the module, and rebuilt in fp32 after every move or cast (``_apply``), so a bf16 model
still rotates by exact angles and a model built on the meta device gets real tables when it is
materialised (``to_empty``). Positions beyond seq_len (generation past the trained context)
are computed on the fly. Tables rather than angles computed inside the layer: under
torch.compile inductor fused the angle computation (pow, Llama 3's band selection, cos, sin)
into the rotation kernel and recomputed it for every element, about 3% of a Llama-3.2-1B
training step on an H200.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.rope import rope, rope_inv_freq, rope_scale, rope_tables


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self.positions = cfg.seq_len
        self.impl = cfg.kernels.rope
        cos, sin = self._tables(self.positions, 0, None)
        self.register_buffer("cos", cos, persistent=False)  # [seq_len, hd/2] fp32
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, length: int, offset: int, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device)  # [hd/2] fp32
        return rope_tables(inv_freq, length, offset, rope_scale(self.scaling))  # YaRN: times its attention factor

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        # whatever fn did to the buffers (a cast, to_empty's uninitialised memory), rebuild them exactly
        self.cos, self.sin = self._tables(self.positions, 0, self.cos.device)
        return self

    def tables(self, T: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, hd/2] (fp32) for positions offset .. offset + T - 1."""
        if offset + T <= self.positions:
            return self.cos[offset:offset + T], self.sin[offset:offset + T]
        return self._tables(T, offset, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, T, hd], k [B, H_kv, T, hd] at positions offset .. offset + T - 1 -> rotated q, k."""
        cos, sin = self.tables(q.shape[-2], offset, q.device)
        return rope(q, cos, sin, self.impl), rope(k, cos, sin, self.impl)
