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
    compile            torch.compile's work inside the first step (Dynamo tracing, Inductor lowering,
                       kernel compilation or cache loads; 0 s without model.compile)
    first_step         the rest of the first optimizer step (warm-up, the step itself)

and counts the rendezvous store's operations. With torch.compile it also says what the compile
caches held (``compile_cache``: the folder, files found at start, FX graph and AOTAutograd cache
hits and misses; megatrain/launch/compile_cache.py), so a warm restart shows as hits. It knows nothing above it (no metrics logger, no
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
          "engine", "checkpoint_restore", "compile", "first_step")


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
        self.compile_cache: dict | None = None  # {"dir", "files_at_start"}: set by whoever chose the folder
        self._compiled_before = compile_stats()  # torch's counts are per process: this start's are the difference

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
            **({"compile_cache": self.compile_cache} if self.compile_cache is not None else {}),
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
        compiled = {k: v - self._compiled_before.get(k, 0) for k, v in compile_stats().items()}
        compile_s = min(step_time_s, max(0.0, round(compiled.pop("compile_s", 0.0), 4)))  # ran inside this step
        self.phases_s["compile"] = compile_s
        self.phases_s["first_step"] = step_time_s - compile_s
        if any(compiled.values()) or compile_s:
            self.compile_cache = {**(self.compile_cache or {}), **compiled}
        self.current = None
        for listener in self.listeners:
            listener(None)
        summary = {**self.summary(), "step": step}
        parts = "  ".join(f"{k} {v:.2f}" for k, v in summary["phases_s"].items())
        cache = summary.get("compile_cache")
        hits = (f"; compile cache: {cache.get('fxgraph_hits', 0)} graph hits, {cache.get('fxgraph_misses', 0)} misses"
                if cache and "fxgraph_hits" in cache else "")
        log.info("start-up: %.2f s to the end of step %d [s: %s  other %.2f]%s", summary["to_first_step_s"], step,
                 parts, summary["other_s"], hits)
        if self.rank == 0:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "startup.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def compile_stats() -> dict:
    """What torch.compile did in this process so far: ``compile_s`` (Dynamo's own timing of every
    forward and backward compile) and the FX graph / AOTAutograd cache hits and misses; {} when
    nothing was compiled (torch._dynamo never imported, or no graph)."""
    import sys

    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return {}
    try:  # torch's own bookkeeping: its names are not a public API, so a rename reads as nothing compiled
        spent = dynamo_utils.calculate_time_spent()
        counters = dynamo_utils.counters
        inductor, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})
        stats = {
            "compile_s": float(spent.get("entire_frame_compile", 0.0)) + float(spent.get("entire_backward_compile", 0.0)),
            "fxgraph_hits": int(inductor.get("fxgraph_cache_hit", 0)),
            "fxgraph_misses": int(inductor.get("fxgraph_cache_miss", 0)),
            "aotautograd_hits": int(aot.get("autograd_cache_hit", 0)),
            "aotautograd_misses": int(aot.get("autograd_cache_miss", 0)),
        }
    except Exception:  # noqa: BLE001
        return {}
    if stats["compile_s"] == 0.0 and not any(stats[k] for k in stats if k != "compile_s"):
        return {}
    stats["compile_s"] = round(stats["compile_s"], 4)
    return stats


def read_startup(run_dir: str | Path) -> dict | None:
    """The start-up breakdown a run wrote, or None (for reports and the flow's artifacts)."""
    path = Path(run_dir) / "startup.json"
    return json.loads(path.read_text()) if path.exists() else None
