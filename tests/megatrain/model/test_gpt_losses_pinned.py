"""The tiny GPT recipe trains exactly as before the Llama family was added.

The first 10 losses of ``configs/tiny-cpu.yaml`` (its model, LAMB and schedule; the recipe's seed;
fixed random token batches; clipping at optim.grad_clip) were recorded from the code before any
Llama part existed (commit 6d86aef). Any change to the GPT's init order, its math or the
optimizer's shows up here at 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.config import load_config
from megatrain.model import GPT
from megatrain.optim import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[3]
RECORDED = [
    7.671238899230957, 7.64538049697876, 7.639072895050049, 7.6522698402404785, 7.644282817840576,
    7.656425476074219, 7.644153118133545, 7.6402130126953125, 7.6446213722229, 7.655585765838623,
]


def first_losses(steps: int = 10) -> list[float]:
    cfg = load_config(ROOT / "configs/tiny-cpu.yaml", ["train.device=cpu", "train.dtype=fp32"])
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_tiny_gpt_first_10_losses_are_unchanged():
    losses = first_losses()
    assert len(losses) == len(RECORDED) == 10
    for step, (got, want) in enumerate(zip(losses, RECORDED), start=1):
        assert abs(got - want) <= 1e-6, f"step {step}: loss {got!r} != recorded {want!r}"
