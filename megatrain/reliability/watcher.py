"""The heartbeat watcher: reads every rank's heartbeat and tells dead ranks from hung ones.

Run by the orchestrator (or a test), never inside a rank. The ranks publish through
``heartbeat.py``'s writer; two failure shapes matter:

- **dead**: the process (or its machine) is gone, so nothing publishes for it any more and its
  record's ``timestamp`` goes stale.
- **hung**: the process is alive - a background thread keeps beating - but the training thread
  is stuck, usually inside a collective waiting for a peer. The timestamp stays fresh while
  ``step`` stops advancing (``step_since`` grows old). The rank whose phase differs from the
  others (e.g. ``forward`` while everyone else waits in ``collective``) is the likely culprit.
- **frozen**: a stuck step whose rank stopped beating too, while its peers still beat: the whole
  process does not run (SIGSTOP, a debugger, a machine that stalls), so its heartbeat thread is as
  still as its training thread. It is the culprit; the peers that still beat are **waiting** (in
  the collective, for it), reported so but not blamed. A frozen process cannot dump its stack: the
  stacks come from the ranks that can still answer, and the report says which could not.

To see *where* a hung rank is stuck, the watcher signals its pid and reads the stack the rank's
``faulthandler`` wrote (``stacks.py``).

A third shape is reported but stops nothing: a **slow** rank (a straggler). Each record carries
the seconds the rank spent in each phase of its last finished step; ``forward`` is the rank's own
compute (its peers' extra time shows up as waiting inside backward's reductions), so a rank whose
forward time stays well above its peers' for several steps is slow. The judgement is
``observe.straggler.slow_ranks``' ratio-to-peers rule, which needs only two ranks, where the
trainer's per-step all-gather monitor (the same function's z-score rule) needs three.

The heartbeat store can fail too (Redis restarted): the watcher treats an unreadable store as
"unknown" - no verdict either way - and, once it reads again, gives every rank a full timeout to
be heard from anew before calling it dead.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatrain.config import ReliabilityConfig
from megatrain.observe.straggler import slow_ranks
from megatrain.reliability.heartbeat import STEP_PHASES, HeartbeatRecord, HeartbeatSink, make_sink
from megatrain.reliability.stacks import ask_stacks, collect_stacks

log = logging.getLogger(__name__)

FROZEN_MIN_S = 2.0  # heartbeat silence that, with a stuck step, means the process is not running
# A writer that began this long before the watcher still counts as this attempt's (clocks of two
# hosts, NTP-synchronised, differ by less); one of an earlier attempt began seconds to hours before.
START_SKEW_S = 1.0
# A wait on another process (megatrain/waits.py) that a rank's record shows this far past its own
# deadline: the call's bound did not end it, so the rank is hung, named by what it waits for.
WAIT_GRACE_S = 5.0


@dataclass
class WatchResult:
    """One check's verdicts. Dead, hung and missing ranks are faults (the job is stopped); slow
    ranks and an unreadable store are reported only."""

    checked_at: float
    records: dict[int, HeartbeatRecord]
    dead: list[int] = field(default_factory=list)  # silent longer than the timeout
    hung: list[int] = field(default_factory=list)  # beating, but the step is frozen
    frozen: list[int] = field(default_factory=list)  # step stuck and the heartbeat silent, peers beating
    waiting: list[int] = field(default_factory=list)  # beating, step stuck, while a peer is frozen: not blamed
    missing: list[int] = field(default_factory=list)  # never heard from within the init grace
    slow: list[int] = field(default_factory=list)  # stragglers: reported, not a fault
    unknown: str | None = None  # the store could not be read: no verdict this time (why)
    notes: list[str] = field(default_factory=list)  # what changed since the last check, for the log

    @property
    def ok(self) -> bool:
        """No fault found. An unreadable store (``unknown``) is no fault: nothing is known."""
        return not (self.dead or self.hung or self.frozen or self.missing)

    def headline(self) -> str:
        if self.unknown is not None:
            return f"heartbeats unknown: {self.unknown}"
        if self.ok:
            return "heartbeats ok" + (f" (slow: {self.slow})" if self.slow else "")
        if self.frozen:
            return (f"fault detected: frozen={self.frozen} (the process stopped: no heartbeat, no step) "
                    f"waiting={self.waiting} (in the collective, for it) dead={self.dead} missing={self.missing}")
        return f"fault detected: dead={self.dead} hung={self.hung} missing={self.missing}"

    @property
    def faulty(self) -> list[int]:
        """The ranks to blame: a waiting rank is stuck only because a frozen one is."""
        return sorted({*self.dead, *self.hung, *self.frozen, *self.missing})

    def status(self, rank: int) -> str:
        for name in ("dead", "frozen", "hung", "missing", "waiting"):
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
            lines += [f"{'':>5} waiting {record.timestamp - w['since']:.1f} s for {_wait_text(w)} (deadline "
                      f"{w['deadline_s']:g} s)" for w in record.waits or []]
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
    So are records of writers that began before it (a rank of an earlier attempt that outlived
    it, signed with the run's token, beating on): they are never news of this attempt's ranks.
    A watcher resumed over a running job passes ``since=0``. A record refused (another run, no
    or a wrong signature, an earlier attempt) changes nothing: each rank is judged from the last
    record of its own that was admitted, and the sinks keep refused records out of its slot.

    A store that cannot be read gives a result with ``unknown`` set and no verdict. When it reads
    again, a rank not heard from since is dead only after a full ``timeout_s`` from that moment
    (a restarted Redis comes back empty; the writers refill it within one interval).

    ``stall_factor``: a hang shows sooner than ``timeout_s`` where steps are short. While every
    rank is mid-step in compute or a collective (``STEP_PHASES``), a step frozen longer than
    ``stall_factor`` x the ranks' median step-to-step time (and at least ``stall_min_s``) is hung: a
    step of 0.1 s frozen for 5 s is no slow step. The stall counts from the later of the step's
    start and the rank's last phase change, so the save or evaluation before a step never counts. Data reads, checkpoint saves, evaluation and
    logging take as long as they take, so a rank in one of those keeps the full ``timeout_s`` for
    the whole job (its peers wait for it in a collective). ``None`` turns the rule off.

    ``slow_factor``: a rank whose forward time of a step exceeds ``1 + slow_factor`` times its
    peers' median in ``slow_steps`` of the last ``slow_steps + 1`` steps seen is reported slow
    (``observe.straggler.slow_ranks``' ratio rule, at any world size; ``None`` turns it off).
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
        stall_factor: float | None = None,
        stall_min_s: float = 5.0,
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
        self.stall_factor, self.stall_min_s = stall_factor, stall_min_s
        # Last record seen per rank: a dead rank's Redis hash may expire, and it must stay dead.
        self._last: dict[int, HeartbeatRecord] = {}
        self._unreadable_since: float | None = None  # the store has failed every read since then
        self._read_failures = 0
        self._readable_again_at = 0.0  # the end of the last outage of the store
        self._forward_s: dict[int, dict[int, float]] = {}  # rank -> {step: forward seconds}
        self._slow: dict[int, str] = {}  # rank -> why it was reported slow

    @classmethod
    def from_config(
        cls, cfg: ReliabilityConfig, run_dir: str | Path, run_id: str, world_size: int, secret: str | None = None
    ) -> HeartbeatWatcher:
        return cls(
            make_sink(cfg, run_dir, run_id, secret), world_size, cfg.heartbeat_timeout_s,
            init_timeout_s=cfg.init_timeout_s, stacks_dir=Path(run_dir) / "stacks",
            slow_factor=cfg.straggler_slowdown, slow_steps=cfg.straggler_steps,
            stall_factor=cfg.stall_factor, stall_min_s=cfg.stall_min_s,
        )

    def check(self) -> WatchResult:
        now = time.time()
        notes: list[str] = []
        try:
            read = self.sink.read_all(self.world_size, started_after=self.since - START_SKEW_S if self.since else None)
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
        # never backwards: a record older than the one already seen is no news (and resets no clock)
        fresh = {r: rec for r, rec in read.items() if rec.timestamp >= self.since
                 and (r not in self._last or rec.timestamp >= self._last[r].timestamp)}
        self._last.update(fresh)
        result = WatchResult(checked_at=now, records=dict(self._last), notes=notes)
        stall_limit = self._stall_limit()
        stalled_steps: set[int] = set()  # steps the stall rule found stuck on some rank
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
                # silent past the timeout: dead, unless its process is here and merely stopped
                # (SIGSTOP, a debugger): then it is frozen, and its peers wait for it
                (result.hung if _stopped_here(record) else result.dead).append(rank)
                continue
            overdue = _overdue_wait(record)
            if overdue is not None:  # in init too: a restore that waits on a stopped keeper is no warm-up
                result.hung.append(rank)
                result.notes.append(f"rank {rank}: {overdue}")
                continue
            warming_up = record.phase == "init" or not record.first_step_done
            limit = self.init_timeout_s if warming_up else self.timeout_s
            if now - record.step_since > limit:
                result.hung.append(rank)
                continue
            # the stall rule counts from the last sign of progress: a step that began after a long
            # save or evaluation has only been stuck since it entered its phase
            stuck_s = now - max(record.step_since, record.phase_since)
            if not warming_up and stall_limit is not None and stuck_s > stall_limit:
                result.hung.append(rank)
                stalled_steps.add(record.step)
                result.notes.append(f"rank {rank}: step {record.step + 1} stuck {stuck_s:.1f} s in {record.phase}, "
                                    f"over the stall limit {stall_limit:.1f} s (before the {self.timeout_s:g} s timeout)")
        if stalled_steps:
            self._add_stuck_peers(result, now, stall_limit, stalled_steps)
        self._tell_frozen_from_waiting(result)
        self._find_slow(fresh, result)
        return result

    @staticmethod
    def _add_stuck_peers(result: WatchResult, now: float, stall_limit: float, steps: set[int]) -> None:
        """A step is one collective: when the stall rule finds a rank stuck in it, the peers stuck
        mid-step in the same step (for over half the limit: not merely slower) hang with it. Which
        of them crosses the limit first is a matter of milliseconds (the rank that hangs in its
        forward and the peer that waits for it in the backward's all-reduce stopped within one
        step of each other), so a verdict that named only the first would as often name the rank
        that waits as the one that holds it up; their stacks tell the two apart."""
        for rank, record in sorted(result.records.items()):
            if rank in result.hung or rank in result.dead or record.step not in steps:
                continue
            stuck_s = now - max(record.step_since, record.phase_since)
            if record.phase in STEP_PHASES and stuck_s > stall_limit / 2:
                result.hung.append(rank)
                result.notes.append(f"rank {rank}: step {record.step + 1} stuck {stuck_s:.1f} s in {record.phase}, "
                                    f"with a peer over the stall limit {stall_limit:.1f} s: the step hangs as one")
        result.hung.sort()

    @staticmethod
    def _tell_frozen_from_waiting(result: WatchResult) -> None:
        """Among the hung ranks, those whose heartbeat went silent along with their step (for more
        than half the time the step is stuck, and at least FROZEN_MIN_S) while a peer still beats
        are frozen; the still-beating ranks mid-step then wait for them."""
        now = result.checked_at

        def silent(rank: int) -> bool:
            record = result.records[rank]
            stuck_s = now - max(record.step_since, record.phase_since)
            return now - record.timestamp > max(FROZEN_MIN_S, stuck_s / 2)

        frozen = [rank for rank in result.hung if silent(rank)]
        beating = [rank for rank in result.records if rank not in frozen and rank not in result.dead]
        if frozen and beating:
            result.frozen = frozen
            # A peer that entered its collective a little after the frozen rank stopped is not over
            # the stall limit yet, but it waits all the same: every beating rank still mid-step does.
            result.waiting = sorted(rank for rank in beating if rank in result.hung
                                    or result.records[rank].phase in STEP_PHASES)
            result.hung = []

    def _stall_limit(self) -> float | None:
        """Seconds after which a frozen step is hung by the stall rule now, or None where the rule
        does not apply: off, a rank not heard from (or not since the store came back), warming
        up, finished, or in a phase that may take long (see the class doc)."""
        if self.stall_factor is None:
            return None
        step_s: list[float] = []
        for rank in range(self.world_size):
            record = self._last.get(rank)
            if record is None or record.timestamp < self._readable_again_at:
                return None
            if record.phase == "done":
                continue
            if record.phase not in STEP_PHASES or not record.first_step_done or not record.recent_step_s:
                return None
            step_s += record.recent_step_s
        if not step_s:
            return None
        return max(self.stall_min_s, self.stall_factor * statistics.median(step_s))

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
        timings = [[self._forward_s[rank][step] for rank in range(self.world_size)] for step in common]
        # "slow in slow_steps of these steps" as a fraction: count/n >= k/n exactly when count >= k
        found = slow_ranks(timings, min_slowdown=self.slow_factor, min_fraction=self.slow_steps / len(common))
        for straggler in found:
            if straggler.rank in self._slow:
                continue  # reported once: the notes say what changed
            self._slow[straggler.rank] = (
                f"rank {straggler.rank} is slow: forward {straggler.ratio:.2f}x its peers' median in "
                f"{straggler.slow_steps} of steps {common[0]}-{common[-1]} (threshold {1 + self.slow_factor:.2f}x)"
            )
            result.notes.append(self._slow[straggler.rank])
            log.warning("%s", self._slow[straggler.rank])
        result.slow = sorted(self._slow)

    def collect_stacks(self, result: WatchResult, ranks: list[int] | None = None) -> dict[int, str]:
        """Stacks of the given ranks (default: all hung ones) that run on this host. A frozen rank
        cannot answer (its signal handler does not run): its peers that wait for it are asked
        instead, and its entry says why it has none (with its process state where this host can
        read it: ``T`` is stopped by a signal, ``t`` by a debugger)."""
        here = socket.gethostname()
        chosen = result.hung if ranks is None else ranks
        chosen = sorted({*chosen, *result.waiting}) if result.frozen else chosen
        pids, remote = {}, {}
        stacks = {}
        for rank in chosen:
            record = result.records.get(rank)
            if record is None:
                continue
            if record.host != here:
                remote[rank] = record
            elif rank in result.frozen:
                stacks[rank] = (f"(frozen: pid {record.pid} does not run ({_process_state(record.pid)}), so it cannot "
                                "dump its stack; the stacks of the ranks waiting for it follow)")
            else:
                pids[rank] = record.pid
        stacks.update(collect_stacks(pids, self.stacks_dir))
        stacks.update(ask_stacks(self.sink, remote))  # on other hosts: through the store
        return stacks

    def close(self) -> None:
        self.sink.close()


def _wait_text(wait: Mapping) -> str:
    return f"{wait.get('what')} at {wait.get('where')}" + (f" (pid {wait['pid']})" if wait.get("pid") else "")


def _overdue_wait(record: HeartbeatRecord) -> str | None:
    """What the rank waits for past the wait's deadline (+ the grace), as of its record, or None."""
    for wait in record.waits or []:
        try:
            waited = record.timestamp - float(wait["since"])
            deadline = float(wait["deadline_s"])
        except (KeyError, TypeError, ValueError):
            continue
        if waited > deadline + WAIT_GRACE_S:
            return f"waiting {waited:.1f} s for {_wait_text(wait)}, past its {deadline:g} s deadline"
    return None


def _stopped_here(record: HeartbeatRecord) -> bool:
    """The rank's process runs on this host and is stopped (state T or t): alive, not beating."""
    return record.host == socket.gethostname() and _process_state(record.pid).startswith(("state T", "state t"))


def _process_state(pid: int) -> str:
    """``state T (stopped)`` from /proc, or why it cannot be told."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    names = {"T": "stopped by a signal", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
             "Z": "exited, not reaped", "R": "running", "S": "sleeping"}
    return f"state {state}: {names.get(state, 'see proc(5)')}"
