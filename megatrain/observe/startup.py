"""Time to first step: where a rank's start-up time goes, measured on every run.

MegaScale (§3.5) found that initialisation, not training, set the recovery time after each of
its restarts: 1,047 s at 2,048 GPUs before its fixes. A ``StartupTimer`` records the phases of
one rank's start-up in order:

    imports            process start -> the timer exists (Python, torch, DeepSpeed imports; from
                       the hand-over for a warm standby, which imported before its attempt)
    store_connect      connect to the rendezvous store (TCPStore or Redis)
    rendezvous         every rank checks in (the join barrier: missing ranks are named)
    world_group        ``init_process_group`` (the world communicator)
    layout_groups      the TP / DP / PP / stage groups
    data_index         shard (rank 0) and load the data index
    model              build the model (on the meta device for large recipes) and parallelize it
    engine             the DeepSpeed engine, with DeepSpeed's own process groups
    checkpoint_restore restore the last committed checkpoint (0 s on a fresh run)
    first_step         the first optimizer step, compile and warm-up included

and counts the rendezvous store's operations. It knows nothing above it (no metrics logger, no
heartbeat): whoever owns those subscribes with ``on_phase`` and reads ``summary()``. Rank 0 writes
the summary to ``<run_dir>/startup.json`` (the latest attempt's), and the trainer puts it in the
first step's row of ``metrics.jsonl`` under ``"startup"`` (one record per attempt; every row stays
a step row for the readers that expect one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("megatrain")

HANDED_OVER_ENV = "MEGATRAIN_HANDED_OVER_AT"  # set by megatrain/training/standby.py when a warm process gets its rank
PHASES = ("imports", "store_connect", "rendezvous", "world_group", "layout_groups", "data_index", "model",
          "engine", "checkpoint_restore", "first_step")


def process_start_time() -> float:
    """Wall-clock time this process was created (from /proc via psutil); now if unknown. A warm
    standby (megatrain/training/standby.py) was created before its attempt: it starts when handed its rank."""
    handed_over = os.environ.get(HANDED_OVER_ENV)
    if handed_over:
        return float(handed_over)
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # no psutil or no /proc: the imports phase reads 0
        return time.time()


class StartupTimer:
    """Seconds per start-up phase of this rank, in the order they ran."""

    def __init__(self, rank: int = 0, started_at: float | None = None) -> None:
        self.rank = rank
        self.started_at = process_start_time() if started_at is None else started_at
        self.phases_s: dict[str, float] = {"imports": max(0.0, time.time() - self.started_at)}
        self.store = None  # the rendezvous store, whose ``ops`` counts are read at the end
        self.current: str | None = None
        self.listeners: list[Callable[[str | None], None]] = []
        self.finished_at: float | None = None

    def on_phase(self, listener: Callable[[str | None], None]) -> None:
        """Call ``listener(phase)`` whenever a phase starts, ``listener(None)`` once start-up is
        over (the heartbeat shows it)."""
        self.listeners.append(listener)
        if self.current is not None:
            listener(self.current)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"start-up phase {name!r}: expected one of {PHASES}")
        self.current = name
        for listener in self.listeners:
            listener(name)
        start = time.perf_counter()
        try:
            yield
        finally:  # a phase entered twice (a rendezvous retried) adds up
            self.phases_s[name] = self.phases_s.get(name, 0.0) + time.perf_counter() - start

    def watch_store(self, store) -> None:
        """Report the operations ``store`` (a ``CountingStore``) has counted by the first step."""
        self.store = store

    def summary(self) -> dict:
        """{"phases_s": ..., "to_first_step_s": wall seconds from process start to the end of the
        first step (or to now), "other_s": the part of it outside the timed phases, "store_ops":
        rendezvous store operations by kind}; phases not (yet) run are absent."""
        wall = (self.finished_at or time.time()) - self.started_at
        return {
            "rank": self.rank,
            "phases_s": {k: round(v, 4) for k, v in self.phases_s.items()},
            "to_first_step_s": round(wall, 4),
            "other_s": round(max(0.0, wall - sum(self.phases_s.values())), 4),
            "store_ops": dict(getattr(self.store, "ops", {})),
            "started_at": round(self.started_at, 3),  # wall clock: lines attempts up with a campaign's log
            "first_step_at": None if self.finished_at is None else round(self.finished_at, 3),
        }

    def first_step(self, step_time_s: float, run_dir: str | Path, step: int) -> dict | None:
        """Called after every step; only the first call of this process records anything (the
        first step's time, the log line, on rank 0 ``startup.json``) and returns the summary for
        the step's metrics row; later calls return None."""
        if self.finished_at is not None:
            return None
        self.finished_at = time.time()
        self.phases_s["first_step"] = step_time_s
        self.current = None
        for listener in self.listeners:
            listener(None)
        summary = {**self.summary(), "step": step}
        parts = "  ".join(f"{k} {v:.2f}" for k, v in summary["phases_s"].items())
        log.info("start-up: %.2f s to the end of step %d [s: %s  other %.2f]", summary["to_first_step_s"], step,
                 parts, summary["other_s"])
        if self.rank == 0:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "startup.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def read_startup(run_dir: str | Path) -> dict | None:
    """The start-up breakdown a run wrote, or None (for reports and the flow's artifacts)."""
    path = Path(run_dir) / "startup.json"
    return json.loads(path.read_text()) if path.exists() else None
