"""Heartbeats: every rank says where it is; a watcher tells dead ranks from hung ones.

Each rank publishes a ``HeartbeatRecord`` (step, phase, loss, throughput, time) through a sink:
Redis on a cluster, a directory of JSON files on one machine. Two failure shapes matter:

- **dead**: the process (or its machine) is gone, so nothing publishes for it any more and its
  record's ``timestamp`` goes stale.
- **hung**: the process is alive - a background thread keeps beating - but the training thread
  is stuck, usually inside a collective waiting for a peer. The timestamp stays fresh while
  ``step`` stops advancing (``step_since`` grows old). The rank whose phase differs from the
  others (e.g. ``forward`` while everyone else waits in ``collective``) is the likely culprit.

To see *where* a hung rank is stuck, the writer registers ``faulthandler`` on SIGUSR1 (see
``stacks.py``): the watcher signals the pid and reads ``<run_dir>/stacks/rank<k>.txt``.

A third shape is reported but stops nothing: a **slow** rank (a straggler). Each record carries
the seconds the rank spent in each phase of its last finished step; ``forward`` is the rank's own
compute (its peers' extra time shows up as waiting inside backward's reductions), so a rank whose
forward time stays well above its peers' for several steps is slow. This needs only two ranks,
where the trainer's per-step all-gather monitor (observe/straggler.py) needs three.

The heartbeat store can fail too (Redis restarted): writers keep training and retry every beat;
the watcher treats an unreadable store as "unknown" - no verdict either way - and, once it reads
again, gives every rank a full timeout to be heard from anew before calling it dead.

Timestamps are wall-clock (``time.time()``) from each rank's host; across hosts this assumes
NTP-synchronised clocks, with skew far below the timeout (seconds vs tens of seconds).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from megatrain.config import ReliabilityConfig
from megatrain.reliability._files import atomic_write_text
from megatrain.reliability.stacks import STACK_SIGNAL, collect_stacks, install_stack_dump, stack_file

log = logging.getLogger(__name__)

RECENT_STEPS = 8  # steps of forward time each record carries
PHASES = ("init", "data", "forward", "backward", "optimizer", "pipeline", "checkpoint", "collective", "done")


@dataclass
class HeartbeatRecord:
    """One rank's latest state. ``timestamp``: when this beat was sent; ``step_since``: when the
    rank first reported ``step`` (so ``timestamp - step_since`` is how long the step has taken).
    ``first_step_done``: this process has finished a step; until then (compile, warm-up) the
    watcher allows the longer init timeout."""

    rank: int
    step: int = 0
    phase: str = "init"
    loss: float | None = None
    tokens_per_s: float | None = None
    timestamp: float = 0.0
    step_since: float = 0.0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    dp_rank: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    straggler: bool = False
    first_step_done: bool = False
    step_phase_s: dict[str, float] | None = None  # seconds per phase of the last finished step
    recent_forward_s: list[list[float]] | None = None  # [step, forward seconds] of the last steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeartbeatRecord:
        # Ignore fields this version does not know: a newer writer must not break an older watcher.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


# ---------------------------------------------------------------------------------------------
# Sinks: where records go. Each holds one record per rank, the latest.


class HeartbeatSink(Protocol):
    def publish(self, record: HeartbeatRecord) -> None: ...

    def read_all(self, world_size: int) -> dict[int, HeartbeatRecord]: ...

    def close(self) -> None: ...


class DirectorySink:
    """One JSON file per rank, replaced atomically: for one machine or a shared filesystem."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, rank: int) -> Path:
        return self.path / f"rank{rank:05d}.json"

    def publish(self, record: HeartbeatRecord) -> None:
        atomic_write_text(self._file(record.rank), json.dumps(record.to_dict()))

    def read_all(self, world_size: int) -> dict[int, HeartbeatRecord]:
        records = {}
        for rank in range(world_size):
            try:
                records[rank] = HeartbeatRecord.from_dict(json.loads(self._file(rank).read_text()))
            except FileNotFoundError:
                continue
        return records

    def close(self) -> None:
        pass


class RedisSink:
    """A Redis hash per rank (``megatrain:<run_id>:heartbeat:<rank>``) with a TTL, so the
    records of a finished or abandoned run clean themselves up."""

    def __init__(self, url: str, run_id: str, ttl_s: float = 300.0) -> None:
        import redis  # imported here: the directory sink must work without a Redis client

        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.run_id = run_id
        self.ttl_s = max(1, math.ceil(ttl_s))
        # One immediate retry (a connection the server dropped is reopened), no backoff: a beat
        # that fails is simply sent again one interval later, and a watcher must not block for
        # seconds in client retries while the store is down.
        self._redis = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0,
                                           retry=Retry(NoBackoff(), 1))

    def key(self, rank: int) -> str:
        return f"megatrain:{self.run_id}:heartbeat:{rank}"

    def publish(self, record: HeartbeatRecord) -> None:
        key = self.key(record.rank)
        fields = {name: json.dumps(value) for name, value in record.to_dict().items()}
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def read_all(self, world_size: int) -> dict[int, HeartbeatRecord]:
        pipe = self._redis.pipeline(transaction=False)
        for rank in range(world_size):
            pipe.hgetall(self.key(rank))
        records = {}
        for rank, raw in enumerate(pipe.execute()):
            if raw:
                data = {k.decode(): json.loads(v) for k, v in raw.items()}
                records[rank] = HeartbeatRecord.from_dict(data)
        return records

    def close(self) -> None:
        self._redis.close()


def make_sink(cfg: ReliabilityConfig, run_dir: str | Path, run_id: str) -> HeartbeatSink:
    """Redis when ``cfg.redis_url`` is set, else ``<run_dir>/heartbeats``."""
    if cfg.redis_url:
        # Keep records well past the timeout so a watcher can still show a dead rank's last state.
        return RedisSink(cfg.redis_url, run_id, ttl_s=max(10 * cfg.heartbeat_timeout_s, 300.0))
    return DirectorySink(Path(run_dir) / "heartbeats")


# ---------------------------------------------------------------------------------------------
# The writer: called by the training loop, publishes from its own thread.


class HeartbeatWriter:
    """Publishes one rank's heartbeat without slowing the step.

    ``beat()`` only updates an in-memory record under a lock. A daemon thread sends it: right
    after a phase change (coalesced, at most once per ``min_gap_s``) and otherwise every
    ``interval_s``. Because the thread beats on its own, a rank blocked in a collective still
    looks alive - with its step frozen - while a dead process goes silent.
    """

    def __init__(
        self,
        sink: HeartbeatSink,
        rank: int,
        *,
        interval_s: float = 2.0,
        min_gap_s: float | None = None,
        stacks_dir: str | Path | None = None,
        dp_rank: int | None = None,
        tp_rank: int | None = None,
        pp_rank: int | None = None,
    ) -> None:
        self.sink = sink
        self.interval_s = interval_s
        self.min_gap_s = interval_s / 20 if min_gap_s is None else min_gap_s
        now = time.time()
        self._record = HeartbeatRecord(
            rank=rank, timestamp=now, step_since=now, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank
        )
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failures = 0
        self._failing_since: float | None = None
        self._phase_start = now
        self._phase_s: dict[str, float] = {}  # the current step's seconds per phase so far
        # A watcher polling slower than steps finish still sees every step's own compute time.
        self._recent_forward: collections.deque[list[float]] = collections.deque(maxlen=RECENT_STEPS)
        self._stack_handle: IO[str] | None = None
        if stacks_dir is not None:
            self._stack_handle = install_stack_dump(stack_file(stacks_dir, rank))
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)
        self._wake.set()  # publish the first record at once
        self._thread.start()

    @property
    def record(self) -> HeartbeatRecord:
        with self._lock:
            return dataclasses.replace(self._record)

    def beat(
        self,
        step: int | None = None,
        phase: str | None = None,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        straggler: bool | None = None,
    ) -> None:
        """Update the record; cheap enough to call at every phase of every step."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase {phase!r}: expected one of {PHASES}")
        with self._lock:
            record = self._record
            now = time.time()
            phase_changed = phase is not None and phase != record.phase
            if phase_changed or (step is not None and step != record.step):
                self._phase_s[record.phase] = self._phase_s.get(record.phase, 0.0) + now - self._phase_start
                self._phase_start = now
            if step is not None and step != record.step:
                # A step set while still in "init" is the one restored from a checkpoint, not progress.
                if record.phase != "init":
                    record.first_step_done = True
                    record.step_phase_s = {k: round(v, 6) for k, v in self._phase_s.items()}
                    self._recent_forward.append([step, record.step_phase_s.get("forward", 0.0)])
                    record.recent_forward_s = list(self._recent_forward)
                self._phase_s = {}
                record.step = step
                record.step_since = now
            if phase is not None:
                record.phase = phase
            if loss is not None:
                record.loss = float(loss)
            if tokens_per_s is not None:
                record.tokens_per_s = float(tokens_per_s)
            if straggler is not None:
                record.straggler = straggler
        if phase_changed:
            self._wake.set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with writer.phase("collective"): ...`` - back to the previous phase afterwards."""
        previous = self.record.phase
        self.beat(phase=name)
        try:
            yield
        finally:
            self.beat(phase=previous)

    def _send(self) -> None:
        with self._lock:
            record = dataclasses.replace(self._record, timestamp=time.time())
        try:
            self.sink.publish(record)
        except Exception as exc:  # a heartbeat-store outage must never stop training
            self._failures += 1
            if self._failures == 1:
                self._failing_since = time.time()
            if self._failures == 1 or self._failures % 100 == 0:
                log.warning("heartbeat publish failed (%d in a row): %s", self._failures, exc)
            return
        if self._failures:
            log.warning("heartbeat publish recovered after %d failures in %.1f s", self._failures,
                        time.time() - (self._failing_since or time.time()))
            self._failures, self._failing_since = 0, None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._send()
            self._stop.wait(self.min_gap_s)  # coalesce bursts of phase changes

    def close(self, phase: str | None = "done") -> None:
        """Stop the thread and publish a final record (phase ``done`` marks a clean exit)."""
        if phase is not None:
            self.beat(phase=phase)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._send()
        if self._stack_handle is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stack_handle.close()
            self._stack_handle = None

    def __enter__(self) -> HeartbeatWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The watcher: run by the orchestrator (or a test), never inside a rank.


@dataclass
class WatchResult:
    checked_at: float
    records: dict[int, HeartbeatRecord]
    dead: list[int] = field(default_factory=list)  # silent longer than the timeout
    hung: list[int] = field(default_factory=list)  # beating, but the step is frozen
    missing: list[int] = field(default_factory=list)  # never heard from within the init grace
    slow: list[int] = field(default_factory=list)  # stragglers: reported, not a fault
    unknown: str | None = None  # the store could not be read: no verdict this time (why)
    notes: list[str] = field(default_factory=list)  # what changed since the last check, for the log

    @property
    def ok(self) -> bool:
        """No fault found. An unreadable store (``unknown``) is no fault: nothing is known."""
        return not (self.dead or self.hung or self.missing)

    def headline(self) -> str:
        if self.unknown is not None:
            return f"heartbeats unknown: {self.unknown}"
        if self.ok:
            return "heartbeats ok" + (f" (slow: {self.slow})" if self.slow else "")
        return f"fault detected: dead={self.dead} hung={self.hung} missing={self.missing}"

    @property
    def faulty(self) -> list[int]:
        return sorted({*self.dead, *self.hung, *self.missing})

    def status(self, rank: int) -> str:
        for name in ("dead", "hung", "missing"):
            if rank in getattr(self, name):
                return name
        return "ok"

    def message(self, stacks: Mapping[int, str] | None = None) -> str:
        """A report for logs and the failed task run: each rank's phase and step, then stacks."""
        lines = [self.headline(), f"{'rank':>5} {'status':<8} {'host':<16} {'pid':>8} {'phase':<11} {'step':>8} "
                       f"{'silent_s':>9} {'stalled_s':>9}"]
        for rank in sorted({*self.records, *self.missing}):
            record = self.records.get(rank)
            if record is None:
                lines.append(f"{rank:>5} {self.status(rank):<8} (no heartbeat)")
                continue
            lines.append(
                f"{rank:>5} {self.status(rank):<8} {record.host[:16]:<16} {record.pid:>8} "
                f"{record.phase:<11} {record.step:>8} {self.checked_at - record.timestamp:>9.1f} "
                f"{self.checked_at - record.step_since:>9.1f}"
            )
        for rank, text in sorted((stacks or {}).items()):
            lines += [f"--- stack of rank {rank} ---", text.rstrip()]
        return "\n".join(lines)


class HeartbeatWatcher:
    """Reads all ranks' records and says which are dead, hung or missing.

    ``timeout_s``: silence (or a frozen step) longer than this is a fault. A rank in ``init``
    or still in its first step (compiling, loading a checkpoint, warming up) may keep its step
    for ``init_timeout_s``, as long as it keeps beating; ranks never heard from get that long to
    appear. A rank in ``done`` finished cleanly and is never flagged.

    Records published before ``since`` (default: when the watcher was made) are ignored: they
    belong to a previous attempt, whose dead ranks must not fail the restart before it begins.
    A watcher resumed over a running job passes ``since=0``.

    A store that cannot be read gives a result with ``unknown`` set and no verdict. When it reads
    again, a rank not heard from since is dead only after a full ``timeout_s`` from that moment
    (a restarted Redis comes back empty; the writers refill it within one interval).

    ``slow_factor``: a rank whose forward time of a step exceeds ``1 + slow_factor`` times its
    peers' median in ``slow_steps`` of the last ``slow_steps + 1`` steps seen is reported slow.
    """

    def __init__(
        self,
        sink: HeartbeatSink,
        world_size: int,
        timeout_s: float,
        *,
        init_timeout_s: float | None = None,
        stacks_dir: str | Path | None = None,
        since: float | None = None,
        slow_factor: float | None = 0.5,
        slow_steps: int = 3,
    ) -> None:
        self.sink = sink
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.init_timeout_s = max(timeout_s, init_timeout_s or timeout_s)
        self.stacks_dir = Path(stacks_dir) if stacks_dir is not None else None
        self.started_at = time.time()
        self.since = self.started_at if since is None else since
        self.slow_factor = slow_factor
        self.slow_steps = slow_steps
        # Last record seen per rank: a dead rank's Redis hash may expire, and it must stay dead.
        self._last: dict[int, HeartbeatRecord] = {}
        self._unreadable_since: float | None = None  # the store has failed every read since then
        self._read_failures = 0
        self._readable_again_at = 0.0  # the end of the last outage of the store
        self._forward_s: dict[int, dict[int, float]] = {}  # rank -> {step: forward seconds}
        self._slow: dict[int, str] = {}  # rank -> why it was reported slow

    @classmethod
    def from_config(
        cls, cfg: ReliabilityConfig, run_dir: str | Path, run_id: str, world_size: int
    ) -> HeartbeatWatcher:
        return cls(
            make_sink(cfg, run_dir, run_id), world_size, cfg.heartbeat_timeout_s,
            init_timeout_s=cfg.init_timeout_s, stacks_dir=Path(run_dir) / "stacks",
            slow_factor=cfg.straggler_slowdown, slow_steps=cfg.straggler_steps,
        )

    def check(self) -> WatchResult:
        now = time.time()
        notes: list[str] = []
        try:
            read = self.sink.read_all(self.world_size)
        except Exception as exc:  # the store is down: we know nothing, so we judge nothing
            self._read_failures += 1
            reason = f"{type(exc).__name__}: {exc}"
            if self._unreadable_since is None:
                self._unreadable_since = now
                notes.append(f"heartbeat store unreadable ({reason}); no verdicts until it is back")
                log.warning("heartbeat store unreadable (%s); no verdicts until it is back", reason)
            elif self._read_failures % 100 == 0:
                log.warning("heartbeat store still unreadable after %.0f s: %s", now - self._unreadable_since, reason)
            return WatchResult(checked_at=now, records=dict(self._last), unknown=reason, notes=notes)
        if self._unreadable_since is not None:
            notes.append(f"heartbeat store readable again after {now - self._unreadable_since:.1f} s "
                         f"({self._read_failures} failed reads)")
            log.warning("%s", notes[-1])
            self._unreadable_since, self._read_failures, self._readable_again_at = None, 0, now
        fresh = {r: rec for r, rec in read.items() if rec.timestamp >= self.since}
        self._last.update(fresh)
        result = WatchResult(checked_at=now, records=dict(self._last), notes=notes)
        for rank in range(self.world_size):
            record = self._last.get(rank)
            if record is None:
                if now - max(self.started_at, self._readable_again_at) > self.init_timeout_s:
                    result.missing.append(rank)
                continue
            if record.phase == "done":
                continue
            if record.timestamp < self._readable_again_at:
                # Last heard before the store's outage ended: silence is counted from its end,
                # and a frozen step cannot be told from a record that was not refreshed yet.
                if now - self._readable_again_at > self.timeout_s:
                    result.dead.append(rank)
                continue
            if now - record.timestamp > self.timeout_s:
                result.dead.append(rank)
                continue
            warming_up = record.phase == "init" or not record.first_step_done
            limit = self.init_timeout_s if warming_up else self.timeout_s
            if now - record.step_since > limit:
                result.hung.append(rank)
        self._find_slow(fresh, result)
        return result

    def _find_slow(self, fresh: dict[int, HeartbeatRecord], result: WatchResult) -> None:
        """Compare each rank's forward time with its peers' on the steps all of them reported."""
        if self.slow_factor is None or self.world_size < 2:
            return
        for rank, record in fresh.items():
            steps = self._forward_s.setdefault(rank, {})
            steps.update({int(step): float(seconds) for step, seconds in record.recent_forward_s or []})
            for old in sorted(steps)[:-64]:
                del steps[old]
        self._forward_s = {rank: steps for rank, steps in self._forward_s.items() if steps}
        if len(self._forward_s) < self.world_size:
            return
        common = sorted(set.intersection(*(set(s) for s in self._forward_s.values())))[-(self.slow_steps + 1):]
        if len(common) < self.slow_steps:
            return
        for rank in range(self.world_size):
            ratios = []
            for step in common:
                peers = [self._forward_s[r][step] for r in range(self.world_size) if r != rank]
                ratios.append(self._forward_s[rank][step] / max(statistics.median(peers), 1e-9))
            slow = [r for r in ratios if r > 1 + self.slow_factor]
            if len(slow) >= self.slow_steps and rank not in self._slow:
                self._slow[rank] = (
                    f"rank {rank} is slow: forward {statistics.median(slow):.2f}x its peers' median in "
                    f"{len(slow)} of steps {common[0]}-{common[-1]} (threshold {1 + self.slow_factor:.2f}x)"
                )
                result.notes.append(self._slow[rank])
                log.warning("%s", self._slow[rank])
        result.slow = sorted(self._slow)

    def collect_stacks(self, result: WatchResult, ranks: list[int] | None = None) -> dict[int, str]:
        """Stacks of the given ranks (default: all hung ones) that run on this host."""
        here = socket.gethostname()
        chosen = result.hung if ranks is None else ranks
        pids = {}
        stacks = {}
        for rank in chosen:
            record = result.records.get(rank)
            if record is None:
                continue
            if record.host != here:
                stacks[rank] = f"(rank runs on {record.host}; collect its stack there)"
            else:
                pids[rank] = record.pid
        stacks.update(collect_stacks(pids, self.stacks_dir))
        return stacks

    def close(self) -> None:
        self.sink.close()
