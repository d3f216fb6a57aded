"""Fault injection: make the failures that recovery must survive happen on purpose.

Off unless faults are listed in ``reliability.faults`` or in the ``MEGATRAIN_FAULTS``
environment variable (a JSON list of ``FaultConfig`` dicts; handy for a relaunch). The trainer
builds one ``FaultInjector`` per rank and calls two hooks:

- ``on_step_start(step)`` - at the top of each step, inside the step's compute timer so that an
  injected slowdown counts as the rank's own time: kill_rank, hang_rank, freeze_rank (SIGSTOP:
  the whole process stops, heartbeat thread included), slow_rank, storage_outage,
  corrupt_checkpoint, corrupt_shard, kill_redis, kill_keeper and corrupt_keeper (the node's
  checkpoint keeper: killed, or this rank's copies in it damaged; ``keeper_faults.py``).
- ``transform_loss(step, loss)`` - on the loss before backward: nan_loss, spike_loss.
- ``collapse_router`` (needs the model: ``from_config(..., model=...)``), at the top of its step:
  from then on every MoE router of the model sends each token to experts 0..top_k-1 (a forward
  hook on the routing, not the weights or the checkpointed bias, so a rollback's restore is clean).

A fault with ``once=True`` claims a marker file in ``<run_dir>/faults/`` *before* it fires
(a SIGKILLed process cannot write afterwards), so the restarted attempt runs clean. A
slow_rank fault keeps slowing every later step of the attempt that claimed it.

Targets are known in advance: ``corrupt_checkpoint`` names a committed step directory (e.g.
``<durable_url>/step-00000006``) and, injected, first waits until that step is committed (the
upload runs beside training, so "the newest checkpoint" is a step the test names, not a race);
``storage_outage`` writes a deadline that the flow's upload task consults (``StorageOutage``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from pydantic import TypeAdapter, ValidationError

from megatrain import storage
from megatrain.config import FaultConfig, ReliabilityConfig
from megatrain.reliability._files import atomic_write_text

log = logging.getLogger(__name__)

FAULTS_ENV = "MEGATRAIN_FAULTS"
STEP_KINDS = {"kill_rank", "hang_rank", "freeze_rank", "slow_rank", "storage_outage", "corrupt_checkpoint",
              "corrupt_shard", "kill_redis", "collapse_router", "kill_keeper", "corrupt_keeper"}
LOSS_KINDS = {"nan_loss", "spike_loss"}
NEEDS_TARGET = {"corrupt_checkpoint", "corrupt_shard", "kill_redis"}
LossT = TypeVar("LossT")


def faults_from_env(environ: Mapping[str, str] = os.environ) -> list[FaultConfig]:
    raw = environ.get(FAULTS_ENV, "").strip()
    if not raw:
        return []
    try:
        data = json.loads(raw)
        return TypeAdapter(list[FaultConfig]).validate_python(data if isinstance(data, list) else [data])
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f"{FAULTS_ENV}: expected a JSON list of faults: {exc}") from None


def fault_key(fault: FaultConfig) -> str:
    """Identity of a fault for its marker: its content, so reordering the list changes nothing."""
    return hashlib.sha1(fault.model_dump_json().encode()).hexdigest()[:12]


class FaultInjector:
    def __init__(self, faults: list[FaultConfig], rank: int, run_dir: str | Path, model: Any = None,
                 staging_dir: str | Path | None = None) -> None:
        for fault in faults:
            if fault.kind in NEEDS_TARGET and not fault.target:
                raise ValueError(f"fault {fault.kind} at step {fault.step}: 'target' is required")
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.model = model  # collapse_router's target (a torch module)
        self.staging_dir = staging_dir  # kill_keeper/corrupt_keeper: the node's keeper is found by it
        self.faults = [fault for fault in faults if fault.rank == rank]
        self.fired: list[tuple[int, str]] = []  # (step, kind) this process fired, for logs and tests
        self._active: set[str] = set()  # markers this process claimed
        self._last_start: float | None = None
        self._injected_s = 0.0
        self._step_s: float | None = None

    @classmethod
    def from_config(
        cls, cfg: ReliabilityConfig, rank: int, run_dir: str | Path, environ: Mapping[str, str] = os.environ,
        model: Any = None, staging_dir: str | Path | None = None,
    ) -> FaultInjector:
        return cls([*cfg.faults, *faults_from_env(environ)], rank, run_dir, model, staging_dir)

    @property
    def enabled(self) -> bool:
        return bool(self.faults)

    def _claim(self, fault: FaultConfig) -> bool:
        """May this fault fire now? Always without ``once``; else only in the attempt that
        created its marker first (O_EXCL makes the claim atomic across processes)."""
        if not fault.once:
            return True
        key = fault_key(fault)
        if key in self._active:
            return True
        marker = self.run_dir / "faults" / f"fired-{fault.kind}-{key}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(fault.model_dump_json())
            handle.flush()
            os.fsync(handle.fileno())
        self._active.add(key)
        return True

    def _due(self, fault: FaultConfig, step: int) -> bool:
        # A slow rank stays slow from its step on; every other fault belongs to one step.
        if fault.kind == "slow_rank":
            return step >= fault.step
        return step == fault.step

    def on_step_start(self, step: int) -> None:
        now = time.monotonic()
        if self._last_start is not None:
            self._step_s = now - self._last_start - self._injected_s  # the step without our delay
        self._last_start, self._injected_s = now, 0.0
        for fault in self.faults:
            if fault.kind in STEP_KINDS and self._due(fault, step) and self._claim(fault):
                self._fire(fault, step)

    def _fire(self, fault: FaultConfig, step: int) -> None:
        self.fired.append((step, fault.kind))
        if fault.kind != "slow_rank":
            log.warning("injecting fault %s on rank %d at step %d", fault.kind, self.rank, step)
        if fault.kind == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang_rank":
            hang_forever()
        elif fault.kind == "freeze_rank":
            os.kill(os.getpid(), signal.SIGSTOP)  # as a debugger or a stalled machine would: nothing runs on
        elif fault.kind == "slow_rank":
            delay = fault.slowdown * (self._step_s or 0.0)
            time.sleep(delay)
            self._injected_s += delay
        elif fault.kind == "storage_outage":
            StorageOutage(self.run_dir).start(fault.duration_s)
        elif fault.kind == "corrupt_checkpoint":
            wait_committed(fault.target or "")
            corrupt_checkpoint(fault.target or "")
        elif fault.kind == "corrupt_shard":
            corrupt_shard(fault.target or "")
        elif fault.kind == "kill_redis":
            kill_redis(fault.target or "")
        elif fault.kind == "collapse_router":
            collapse_routers(self.model)
        elif fault.kind in ("kill_keeper", "corrupt_keeper"):  # the node's checkpoint keeper (keeper_faults.py)
            from megatrain.reliability.keeper_faults import corrupt_keeper, kill_keeper

            (kill_keeper if fault.kind == "kill_keeper" else corrupt_keeper)(self.staging_dir, self.rank)

    def transform_loss(self, step: int, loss: LossT) -> LossT:
        """Works on a float or a tensor; a tensor keeps its autograd graph."""
        for fault in self.faults:
            if fault.kind in LOSS_KINDS and step == fault.step and self._claim(fault):
                self.fired.append((step, fault.kind))
                log.warning("injecting fault %s on rank %d at step %d", fault.kind, self.rank, step)
                loss = loss * (float("nan") if fault.kind == "nan_loss" else fault.magnitude)  # type: ignore[operator]
        return loss


def collapse_routers(model: Any) -> int:
    """Force every MoE router of ``model`` to pick experts 0..k-1 for every token, for the rest
    of this process (a collapsed router as training can produce it); returns the routers hooked."""
    import torch  # here: tasks/ import this module for StorageOutage and must not load torch

    from megatrain.model.moe import Router, Routing

    def force(router: Router, _inputs: tuple, routing: Routing) -> Routing:
        chosen = torch.arange(routing.experts.shape[1], device=routing.experts.device).expand_as(routing.experts)
        return Routing(routing.logits, routing.probs, chosen, routing.weights)

    routers = [m for m in (model.modules() if model is not None else []) if isinstance(m, Router)]
    if not routers:
        raise ValueError("fault collapse_router: the model has no MoE router (model.mlp=moe)")
    for router in routers:
        router.register_forward_hook(force)
    return len(routers)


def hang_forever() -> None:
    """Block like a rank stuck in a collective (named so that a stack dump shows it)."""
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------
# Storage outage: a deadline in a file, so uploaders in any thread or process of the run see it.


class StorageOutage:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "faults" / "storage_outage_until"

    def start(self, duration_s: float) -> None:
        atomic_write_text(self.path, str(time.time() + duration_s))

    def active(self) -> bool:
        try:
            return time.time() < float(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return False

    def wrap(self, fs: fsspec.AbstractFileSystem) -> FlakyFileSystem:
        return FlakyFileSystem(fs, self.active)


class FlakyFileSystem:
    """An fsspec filesystem whose every public method fails while ``is_down()`` is true.

    A proxy rather than an ``AbstractFileSystem`` subclass: fsspec caches filesystem instances
    by their constructor arguments, and a wrapper must not share state with the wrapped one.
    Files opened before the outage keep working, as with a real network blip.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, is_down: Callable[[], bool]) -> None:
        self._fs = fs
        self._is_down = is_down

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self._is_down():
                raise ConnectionError(f"injected storage outage: {name}{args[:1]} refused")
            return attr(*args, **kwargs)

        return guarded


# ---------------------------------------------------------------------------------------------
# Corruption and Redis faults, also called directly by tests and the chaos benchmark.


def corrupt_file(url: str, nbytes: int = 64) -> str:
    """Invert ``nbytes`` in the middle of a file (any storage URL); the size is unchanged, so
    only a checksum can tell."""
    fs, path = storage.resolve(url)
    data = bytearray(fs.cat_file(path))
    if not data:
        raise ValueError(f"{url}: empty file, nothing to corrupt")
    start = max(0, len(data) // 2 - nbytes // 2)
    for i in range(start, min(len(data), start + nbytes)):
        data[i] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    return url


def _largest_file(url: str) -> str:
    fs, path = storage.resolve(url)
    if not fs.isdir(path):
        return url
    sizes = {name: info["size"] for name, info in storage.find(url).items()}
    if not sizes:
        raise ValueError(f"{url}: no files to corrupt")
    return max(sizes, key=lambda name: (sizes[name], name))


def wait_committed(url: str, timeout_s: float = 300.0, poll_s: float = 0.1) -> None:
    """Wait until a checkpoint step directory has its manifest (or a plain file exists)."""
    from megatrain.checkpoint.files import MANIFEST

    fs, path = storage.resolve(url)
    looks_like_step = Path(path).name.startswith("step-")
    wanted = storage.join_url(url, MANIFEST) if looks_like_step or fs.isdir(path) else url
    deadline = time.monotonic() + timeout_s
    while not storage.exists(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"corrupt_checkpoint: {wanted} did not appear within {timeout_s:.0f} s")
        time.sleep(poll_s)


def corrupt_checkpoint(url: str) -> str:
    """Corrupt a checkpoint file, or the largest file of a checkpoint directory (its tensors,
    not its manifest). Returns the URL of the corrupted file."""
    return corrupt_file(_largest_file(url))


def corrupt_shard(url: str) -> str:
    """Corrupt a data shard (or the largest shard of a directory). Returns its URL."""
    return corrupt_file(_largest_file(url))


def kill_redis(target: int | str) -> int:
    """SIGKILL a redis-server given its pid or a pid file. Returns the pid."""
    pid = int(target) if str(target).strip().isdigit() else int(Path(target).read_text().strip())
    os.kill(pid, signal.SIGKILL)
    return pid
