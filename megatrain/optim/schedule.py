"""Learning-rate schedules: linear warm-up, then cosine decay to min_lr, WSD or constant.

WSD (warm-up, stable, decay): ``lr`` until the final decay, then ``1 - sqrt`` down to ``min_lr``
over ``decay_steps`` (default ``decay_fraction`` of the run). The LR of a step depends on the run's
length only inside that final decay, so a run extended while stable goes on at the same LR
(with cosine the whole curve stretches, and the LR at the resume step jumps back up).
"""

from __future__ import annotations

import math

import torch

from megatrain.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay = cfg.decay_steps or max(1, round(cfg.decay_fraction * total_steps))
        start = max(cfg.warmup_steps, total_steps - decay)
        if step < start:
            return cfg.lr
        progress = min(1.0, (step - start + 1) / decay)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 - math.sqrt(progress))
    decay_steps = max(1, (cfg.decay_steps or total_steps) - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor makes each group's lr equal ``lr_at`` (groups start at cfg.lr)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)
