"""A small in-process trainer with everything a checkpoint holds (model, optimizer, LR schedule,
loader position, counters, every RNG), so the checkpoint package is tested in seconds without
DeepSpeed. The DeepSpeed/ZeRO path is covered end to end by test_resume.py.

The random generators a checkpoint restores are the process's own (torch's, python's, numpy's):
in a test worker every thread shares them, a library's retry jitter in a thread left by another
test included. So a fake trainer draws from them only when asked (``draws_globals``), and the
check that asks runs in a process of its own (``resume_generators.py``); the others' trainers are
deterministic without them (weights from a generator of their own, no dropout).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import numpy as np
import torch
import torch.nn as nn
from fsspec.implementations.local import LocalFileSystem

from megatrain.checkpoint.manager import Checkpointer
from megatrain.config import Config
from megatrain.config import load_config
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.init import DistEnv


class FakeLoader:
    """Deterministic batches by position; state is plain JSON like the real loader's."""

    def __init__(self, seed: int = 0):
        self.seed, self.position = seed, 0

    def __next__(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.position)
        self.position += 1
        return torch.randn(8, 16, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.position = state["seed"], state["position"]


@dataclass
class FakeTrainer:
    cfg: Config
    env: DistEnv
    groups: ProcessGroups
    engine: Any
    loader: FakeLoader
    step: int = 0
    draws_globals: bool = False  # dropout and a scale from python's and numpy's process-wide generators

    def train_step(self) -> None:
        x = next(self.loader)
        model, optimizer = self.engine.module, self.engine.optimizer
        scale = 1.0
        if self.draws_globals:  # every generator a checkpoint must restore: torch (dropout), python, numpy
            scale += 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        loss = (model(x) * scale).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        self.engine.lr_scheduler.step()
        self.engine.global_steps += 1
        self.step += 1


def make_config(tmp: Path, **checkpoint: Any) -> Config:
    overrides = [f"checkpoint.staging_dir={tmp / 'staging'}", f"checkpoint.durable_url={checkpoint.pop('durable_url', tmp / 'durable')}",
                 "train.steps=100", "checkpoint.upload_backoff_s=0.05", "checkpoint.commit_timeout_s=30"]
    overrides += [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
    return load_config(None, overrides)


def make_trainer(cfg: Config, seed: int = 0, draws_globals: bool = False) -> FakeTrainer:
    """A fake trainer whose weights, data and (with ``draws_globals``) process-wide generators
    follow from ``seed``."""
    if draws_globals:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
    model = nn.Sequential(nn.utils.skip_init(nn.Linear, 16, 32), nn.GELU(),
                          nn.Dropout(0.1) if draws_globals else nn.Identity(), nn.utils.skip_init(nn.Linear, 32, 16))
    weights = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=weights) * 0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    engine = SimpleNamespace(module=model, optimizer=optimizer, lr_scheduler=scheduler,
                             global_steps=0, global_samples=0, micro_steps=0, skipped_steps=0)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    groups = ProcessGroups(dims=ParallelDims(dp=1, tp=1, pp=1), rank=0)
    return FakeTrainer(cfg=cfg, env=env, groups=groups, engine=engine, loader=FakeLoader(seed),
                       draws_globals=draws_globals)


def run(trainer: FakeTrainer, checkpointer: Checkpointer, until: int) -> None:
    while trainer.step < until:
        trainer.train_step()
        checkpointer.maybe_save(trainer)


def full_state(trainer: FakeTrainer) -> dict[str, torch.Tensor]:
    """Everything that decides the next step, as tensors to compare bit for bit."""
    out = {f"model.{k}": v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
    for i, p in enumerate(trainer.engine.module.parameters()):
        for k, v in trainer.engine.optimizer.state[p].items():
            out[f"optim.{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    out["lr"] = torch.tensor(trainer.engine.optimizer.param_groups[0]["lr"], dtype=torch.float64)
    if trainer.draws_globals:
        out["torch_rng"] = torch.get_rng_state()
        out["python_rng"] = torch.tensor(random.getstate()[1])
        out["numpy_rng"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    out["position"] = torch.tensor(trainer.loader.position)
    return out


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


class FlakyFileSystem(LocalFileSystem):
    """Local files under ``flaky://``, unreachable (OSError) until ``down_until`` (monotonic time):
    a storage outage at the fsspec layer, below megatrain.storage."""

    protocol = ("flaky",)
    down_until = 0.0
    failures = 0

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(*args, **kwargs)

    def _check(self) -> None:
        if time.monotonic() < FlakyFileSystem.down_until:
            FlakyFileSystem.failures += 1
            raise OSError("flaky: storage service unavailable")

    def _open(self, *args: Any, **kwargs: Any):
        self._check()
        return super()._open(*args, **kwargs)

    def info(self, *args: Any, **kwargs: Any):
        self._check()
        return super().info(*args, **kwargs)

    def ls(self, *args: Any, **kwargs: Any):
        self._check()
        return super().ls(*args, **kwargs)

    def mv(self, *args: Any, **kwargs: Any):
        self._check()
        return super().mv(*args, **kwargs)

    def rm(self, *args: Any, **kwargs: Any):
        self._check()
        return super().rm(*args, **kwargs)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
