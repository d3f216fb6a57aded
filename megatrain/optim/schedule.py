"""Learning-rate schedules as functions of the step, and the test that a resume continues one.

Kinds: linear warm-up, then cosine decay to ``min_lr``, WSD or constant. WSD (warm-up, stable,
decay): ``lr`` until the final decay, then ``1 - sqrt`` down to ``min_lr`` over ``decay_steps``
(default ``decay_fraction`` of the run). The LR of a step depends on the run's length only inside
that final decay, so a run extended while stable goes on at the same LR (with cosine the whole
curve stretches).

A ``Schedule`` is the whole function: the kind, its numbers, the run's length and the restarts a
resume applied (below). The trainer's LambdaLR calls it, so its fields travel in the scheduler's
state into every checkpoint, and a restore compares *functions*, not fields (``resume_difference``):
a resume is exact when this run's schedule gives every step the checkpoint's run trained the LR it
had, and every step to come the LR the checkpoint's schedule gives it at this run's length. A WSD
run extended after its decay began is not: its decayed steps would have been stable ones.

Such a resume is refused unless it asks for one of two explicit, continuous transitions from the
LR the checkpoint's run had at the resume step (``checkpoint.resume_lr``), recorded as a restart:

- ``redecay``: decay from that LR to ``min_lr`` by the end of this run (the kind's own shape);
- ``rewarm``: go linearly from it to this run's schedule over ``rewarm_steps``, then follow it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.config import OptimConfig

RESTART_MODES = ("redecay", "rewarm")
_REL_TOL = 1e-9  # two LRs this close are the same LR (one formula, evaluated in two processes)


@dataclass
class Schedule:
    """The LR of every optimizer step (0-based) of one run. Plain JSON fields: LambdaLR saves a
    callable object's ``__dict__`` in its state, so each checkpoint records the function."""

    kind: str
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int | None
    decay_fraction: float
    total_steps: int
    # {"step", "mode": redecay | rewarm, "from_lr", "steps"}: from "step" on, a transition a resume chose
    restarts: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: OptimConfig, total_steps: int) -> Schedule:
        return cls(cfg.schedule, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps, cfg.decay_fraction, total_steps)

    @classmethod
    def from_record(cls, record: Any) -> Schedule | None:
        """The schedule a checkpoint recorded (None: written before schedules were recorded)."""
        if not isinstance(record, dict) or "kind" not in record:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_length(self, total_steps: int) -> Schedule:
        return dataclasses.replace(self, total_steps=total_steps, restarts=list(self.restarts))

    def decay_start(self) -> int | None:
        """The first step of the decay (None: constant has none)."""
        if self.kind == "constant":
            return None
        if self.kind == "wsd":
            decay = self.decay_steps or max(1, round(self.decay_fraction * self.total_steps))
            return max(self.warmup_steps, self.total_steps - decay)
        return self.warmup_steps

    def base(self, step: int) -> float:
        """The kind's own curve, without restarts."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        if self.kind == "wsd":
            decay = self.decay_steps or max(1, round(self.decay_fraction * self.total_steps))
            start = max(self.warmup_steps, self.total_steps - decay)
            if step < start:
                return self.lr
            progress = min(1.0, (step - start + 1) / decay)
            return self.min_lr + (self.lr - self.min_lr) * (1 - math.sqrt(progress))
        decay_steps = max(1, (self.decay_steps or self.total_steps) - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def at(self, step: int) -> float:
        """The LR of ``step``: the curve, or from the last restart at or before it, its transition."""
        restart = next((r for r in reversed(self.restarts) if r["step"] <= step), None)
        if restart is None:
            return self.base(step)
        begin, from_lr = int(restart["step"]), float(restart["from_lr"])
        if restart["mode"] == "rewarm":
            end = begin + int(restart["steps"])
            if step >= end:
                return self.base(step)
            return from_lr + (self.base(end) - from_lr) * (step - begin) / (end - begin)
        span = self.total_steps - 1 - begin  # redecay: from_lr at `begin`, min_lr at the last step
        progress = 1.0 if span <= 0 else min(1.0, (step - begin) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - math.sqrt(progress)
        return self.min_lr + (from_lr - self.min_lr) * shape

    def __call__(self, step: int) -> float:
        """LambdaLR's factor: the param groups start at ``lr`` (a rollback may scale their base)."""
        return self.at(step) / self.lr

    def restarted(self, step: int, mode: str, from_lr: float, steps: int) -> Schedule:
        """This schedule with a transition from ``from_lr`` at ``step`` (``steps``: rewarm's length)."""
        if mode not in RESTART_MODES:
            raise ValueError(f"restart mode must be one of {RESTART_MODES}, got {mode!r}")
        kept = [r for r in self.restarts if r["step"] < step]
        entry = {"step": step, "mode": mode, "from_lr": from_lr, "steps": max(1, steps) if mode == "rewarm" else 0}
        return dataclasses.replace(self, restarts=[*kept, entry])


@dataclass(frozen=True)
class Difference:
    """The first step at which a resumed run's LR would not be the checkpointed schedule's."""

    step: int
    checkpoint_lr: float
    this_lr: float
    trained: bool  # the step was trained already (under the checkpoint's run) or is still to come

    def describe(self) -> str:
        when = "trained step" if self.trained else "would train step"
        return f"the checkpoint's run {when} {self.step} at LR {self.checkpoint_lr:.3e}, this run's schedule gives {self.this_lr:.3e}"


def same_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-15)


def resume_difference(saved: Schedule, mine: Schedule, resume_step: int) -> Difference | None:
    """None when resuming ``saved`` at ``resume_step`` under ``mine`` is exact: every step since
    the last restart up to the resume step had the LR ``mine`` gives it, and every later step of
    ``mine`` gets the LR ``saved`` gives it at ``mine``'s length (the length may change; nothing
    else). ``mine`` takes over ``saved``'s restarts first (a rewarmed run stays rewarmed)."""
    mine = dataclasses.replace(mine, restarts=list(saved.restarts))
    if saved.record() == mine.record():
        return None  # the same function: nothing to evaluate
    since = max([r["step"] for r in saved.restarts if r["step"] <= resume_step], default=0)
    for step in range(since, resume_step):  # the steps trained
        if not same_lr(saved.at(step), mine.at(step)):
            return Difference(step, saved.at(step), mine.at(step), trained=True)
    stretched = saved.with_length(mine.total_steps)
    for step in range(resume_step, mine.total_steps):  # the steps to come
        if not same_lr(stretched.at(step), mine.at(step)):
            return Difference(step, stretched.at(step), mine.at(step), trained=False)
    return None


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    return Schedule.of(cfg, total_steps).at(step)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor makes each group's lr equal the schedule's (groups start at cfg.lr);
    the ``Schedule`` is its lambda, so ``scheduler.lr_lambdas[0]`` is this run's function."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule.of(cfg, total_steps))
