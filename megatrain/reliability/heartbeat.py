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

The heartbeat store can fail (Redis restarted): writers keep training and retry every beat. What
is stored, where, and which records a reader believes: ``heartbeat_store.py`` (its names are
importable from here too).

Timestamps are wall-clock (``time.time()``) from each rank's host; across hosts this assumes
NTP-synchronised clocks, with skew far below the timeout (seconds vs tens of seconds).
"""


from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from megatrain import waits
from megatrain.reliability.heartbeat_store import (  # noqa: F401  (the store's names, importable from here)
    PHASES, RECENT_STEPS, STEP_PHASES, DirectorySink, HeartbeatRecord, HeartbeatSink, RedisSink, make_sink, writer_id,
)
from megatrain.reliability.stacks import STACK_SIGNAL, install_stack_dump, own_stacks, stack_file

log = logging.getLogger(__name__)

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
        self._answered: str | None = None  # the last stack request answered
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
        with self._lock:  # with what this process waits for now (a keeper, the store, ...): megatrain/waits.py
            record = dataclasses.replace(self._record, timestamp=time.time(), waits=waits.current() or None)
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

    def _answer_stack_request(self) -> None:
        """A watcher on another host asked for this process's stacks (``RedisSink.request_stacks``):
        this thread runs while the main thread sits in a collective, so it answers for it."""
        try:
            request = self.sink.stack_request()
            if request is None or request == self._answered:
                return
            record = self.record
            self.sink.publish_stacks(record.rank, request, own_stacks(), record.host, record.pid)
            self._answered = request
        except Exception as exc:  # the store's outage: heartbeats say so already; asked again next beat
            log.debug("stack request not answered: %s", exc)

    def _run(self) -> None:
        answers = hasattr(self.sink, "stack_request")  # a store every host reaches (Redis)
        while not self._stop.is_set():
            self._wake.wait(timeout=self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._send()
            if answers:
                self._answer_stack_request()
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
