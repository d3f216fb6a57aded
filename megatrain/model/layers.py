"""The model's building blocks: LayerNorm, attention and MLP, each calling a kernel dispatch."""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.attention import causal_attention
from megatrain.kernels.gelu import bias_gelu
from megatrain.kernels.layernorm import layer_norm


class LayerNorm(nn.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None
        self.eps = cfg.norm_eps
        self.impl = cfg.kernels.layernorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.impl)


class Attention(nn.Module):
    """Multi-head causal self-attention (full or sliding window).

    The head count is read from the projection's width at run time, so tensor parallelism can
    swap ``qkv`` for a column-parallel linear holding only this rank's heads.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.window = cfg.window if cfg.attention == "sliding" else None
        self.impl = cfg.kernels.attention
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """The part between the two projections: qkv [B, T, 3 * H * hd] -> [B, T, H * hd].
        ``qkv`` may be a strided view (the fused input projection of the parallel block)."""
        B, T, width = qkv.shape
        n_head = width // (3 * self.head_dim)
        # split, not unbind: the backward is then one concatenation of dq, dk, dv (which
        # inductor writes straight into the fused projection's gradient buffer) instead of a
        # scatter into zeros per q/k/v
        q, k, v = (t.unflatten(-1, (n_head, self.head_dim)).transpose(1, 2) for t in qkv.split(width // 3, dim=-1))
        y = causal_attention(q, k, v, self.window, self.impl)  # [B, H, T, hd]
        return y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)


class MLP(nn.Module):
    """fc -> bias + GeLU (one fused op) -> proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.impl = cfg.kernels.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(x, self.fc.weight)  # [B, T, ff]; bias goes into the GeLU kernel
        return self.proj(self.activate(h, self.fc.bias))

    def activate(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """gelu(h + bias), the part between the two projections."""
        return bias_gelu(h, bias, self.impl)
