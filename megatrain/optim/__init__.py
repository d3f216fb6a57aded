"""Optimizers (LAMB, AdamW) and the learning-rate schedule."""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import OptimConfig
from megatrain.optim.lamb import Lamb, TensorSegments
from megatrain.optim.schedule import build_scheduler, lr_at

__all__ = ["Lamb", "TensorSegments", "build_optimizer", "build_scheduler", "lr_at", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2); never biases or LayerNorm gains."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, max_trust_ratio=cfg.max_trust_ratio)
    # foreach AdamW on CPU; the fused CUDA kernel on GPU
    fused = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None, foreach=None if fused else True)
