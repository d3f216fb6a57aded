"""Heartbeats, the writer side: every rank says where it is, from a thread of its own.

Each rank publishes a ``HeartbeatRecord`` (step, phase, loss, throughput, time) through a sink:
Redis on a cluster, a directory of JSON files on one machine. The watcher (``watcher.py``, run by
the orchestrator, never inside a rank) reads them back to tell dead ranks from hung ones, which
is why the record carries two clocks:

- ``timestamp`` is refreshed by every beat, so it goes stale only when the process (or its
  machine) is gone: a **dead** rank.
- ``step_since`` moves only when ``step`` does. A background thread keeps beating while the
  training thread is stuck - usually inside a collective waiting for a peer - so a **hung**
  rank has a fresh timestamp and an old ``step_since``; its ``phase`` says where it stopped.

To show *where* a hung rank is stuck, the writer registers ``faulthandler`` on SIGUSR1 (see
``stacks.py``): the watcher signals the pid and reads ``<run_dir>/stacks/rank<k>.txt``.

Each record also carries the seconds the rank spent in each phase of its last finished step, and
the forward seconds of its last few steps, from which the watcher finds slow ranks (stragglers).

The heartbeat store can fail (Redis restarted): writers keep training and retry every beat.

A record must come from this run, or a stray writer (another run sharing the store, a copied file,
anyone who reaches Redis) could make a hung rank look alive. ``make_sink`` gives each sink the
run's ``Identity``: writers stamp the run id and, when the environment holds the run's token
(``MEGATRAIN_RUN_TOKEN``, made by the launcher and inherited by its ranks), an HMAC of the record;
readers ignore, and log once, a record of another run or without a valid signature (``identity.py``).

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
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from megatrain.config import ReliabilityConfig
from megatrain.reliability._files import atomic_write_text
from megatrain.reliability.identity import RUN_TOKEN_ENV, Identity, admitted
from megatrain.reliability.stacks import STACK_SIGNAL, install_stack_dump, stack_file

log = logging.getLogger(__name__)

RECENT_STEPS = 8  # steps of forward time each record carries
PHASES = ("init", "data", "forward", "backward", "optimizer", "pipeline", "checkpoint", "collective", "eval", "log",
          "done")
# The phases of a step whose length is the step's own: compute and the collectives between ranks.
# A frozen step is called hung sooner (the watcher's stall rule) only while every rank is in one
# of these; data reads, checkpoint saves, evaluation and logging may legitimately take longer.
STEP_PHASES = frozenset({"forward", "backward", "optimizer", "pipeline", "collective"})


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
    phase_since: float = 0.0  # when the rank entered ``phase`` (any phase change is progress)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    dp_rank: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    straggler: bool = False
    first_step_done: bool = False
    step_phase_s: dict[str, float] | None = None  # seconds per phase of the last finished step
    recent_forward_s: list[list[float]] | None = None  # [step, forward seconds] of the last steps
    recent_step_s: list[float] | None = None  # seconds from step to step of the last steps (the stall rule's scale)
    init_phase: str | None = None  # during phase "init": the start-up phase (megatrain/observe/startup.py)
    run_id: str | None = None  # whose record this is (stamped by the sink's Identity)
    signature: str | None = None  # HMAC-SHA256 of the rest under the run's token

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
    """One JSON file per rank, replaced atomically: for one machine or a shared filesystem.
    ``identity``: stamp and check records (None: take any, as tests of the watcher's rules do)."""

    def __init__(self, path: str | Path, identity: Identity | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.identity = identity

    def _file(self, rank: int) -> Path:
        return self.path / f"rank{rank:05d}.json"

    def publish(self, record: HeartbeatRecord) -> None:
        if self.identity is not None:
            record = self.identity.stamp(record)
        atomic_write_text(self._file(record.rank), json.dumps(record.to_dict()))

    def read_all(self, world_size: int) -> dict[int, HeartbeatRecord]:
        records = {}
        for rank in range(world_size):
            try:
                records[rank] = HeartbeatRecord.from_dict(json.loads(self._file(rank).read_text()))
            except FileNotFoundError:
                continue
        return admitted(self.identity, records, str(self.path))

    def close(self) -> None:
        pass


class RedisSink:
    """A Redis hash per rank (``megatrain:<run_id>:heartbeat:<rank>``) with a TTL, so the
    records of a finished or abandoned run clean themselves up."""

    def __init__(self, url: str, run_id: str, ttl_s: float = 300.0, identity: Identity | None = None) -> None:
        # imported here: the directory sink must work without a Redis client
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from megatrain.launch.redis_client import connect

        self.run_id = run_id
        self.identity = identity
        self.ttl_s = max(1, math.ceil(ttl_s))
        # One immediate retry (a connection the server dropped is reopened), no backoff: a beat
        # that fails is simply sent again one interval later, and a watcher must not block for
        # seconds in client retries while the store is down.
        self._redis = connect(url, socket_timeout=5.0, socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 1))

    def key(self, rank: int) -> str:
        return f"megatrain:{self.run_id}:heartbeat:{rank}"

    def publish(self, record: HeartbeatRecord) -> None:
        if self.identity is not None:
            record = self.identity.stamp(record)
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
        return admitted(self.identity, records, f"megatrain:{self.run_id}:heartbeat:*")

    def close(self) -> None:
        self._redis.close()


def make_sink(cfg: ReliabilityConfig, run_dir: str | Path, run_id: str) -> HeartbeatSink:
    """Redis when ``cfg.redis_url`` is set, else ``<run_dir>/heartbeats``; either way taking only
    this run's records (signed when the environment holds the run's token)."""
    identity = Identity(run_id, os.environ.get(RUN_TOKEN_ENV))
    if cfg.redis_url:
        # Keep records well past the timeout so a watcher can still show a dead rank's last state.
        return RedisSink(cfg.redis_url, run_id, ttl_s=max(10 * cfg.heartbeat_timeout_s, 300.0), identity=identity)
    return DirectorySink(Path(run_dir) / "heartbeats", identity=identity)


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
            rank=rank, timestamp=now, step_since=now, phase_since=now, dp_rank=dp_rank, tp_rank=tp_rank,
            pp_rank=pp_rank,
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
        self._recent_step: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
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
                    if record.first_step_done:  # the first step's time is the warm-up's, not a step's
                        self._recent_step.append(round(now - record.step_since, 6))
                        record.recent_step_s = list(self._recent_step)
                    record.first_step_done = True
                    record.step_phase_s = {k: round(v, 6) for k, v in self._phase_s.items()}
                    self._recent_forward.append([step, record.step_phase_s.get("forward", 0.0)])
                    record.recent_forward_s = list(self._recent_forward)
                self._phase_s = {}
                record.step = step
                record.step_since = now
            if phase_changed:
                record.phase, record.phase_since = phase, now
            if loss is not None:
                record.loss = float(loss)
            if tokens_per_s is not None:
                record.tokens_per_s = float(tokens_per_s)
            if straggler is not None:
                record.straggler = straggler
        if phase_changed:
            self._wake.set()

    def set_init_phase(self, name: str | None) -> None:
        """Which start-up phase this rank is in (None once start-up is over): a rank hung while
        starting shows where (rendezvous, model, engine, ...)."""
        with self._lock:
            self._record.init_phase = name
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
