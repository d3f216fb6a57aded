"""Normalisation layers: LayerNorm (GPT-2; ``model.norm=layernorm``) and RMSNorm (Llama;
``model.norm=rmsnorm``), each calling its kernel dispatch.

State-dict names: ``weight`` [d] (both), ``bias`` [d] (LayerNorm with ``model.bias`` only).
Hugging Face Llama: ``input_layernorm.weight`` / ``post_attention_layernorm.weight`` / ``norm.weight``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.layernorm import layer_norm
from megatrain.kernels.rmsnorm import rms_norm, rms_norm_with_skip


class LayerNorm(nn.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None
        self.eps = cfg.norm_eps
        self.impl = cfg.kernels.layernorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.impl)


class RMSNorm(nn.Module):
    """x / rms(x) * weight; no mean subtraction and no bias (Llama)."""

    def __init__(self, dim: int, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = cfg.norm_eps
        self.impl = cfg.kernels.rmsnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.impl)

    def with_skip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), x), the second carrying the skip connection's gradient into the norm's backward
        (``kernels.rmsnorm.rms_norm_with_skip``)."""
        return rms_norm_with_skip(x, self.weight, self.eps, self.impl)


NORMS = (LayerNorm, RMSNorm)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.d_model, cfg) if cfg.norm == "rmsnorm" else LayerNorm(cfg.d_model, cfg)
