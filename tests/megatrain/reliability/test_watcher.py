"""The heartbeat watcher: verdicts from records (dead, hung, missing, warming up), records of a
previous attempt, a store outage (no verdict, then a grace), slow ranks, and real processes
killed and hung (with the hung one's stack)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from heartbeat_helpers import make, wait_for

from megatrain.reliability.heartbeat import DirectorySink, HeartbeatRecord
from megatrain.reliability.watcher import HeartbeatWatcher


class _FlakySink:
    """An in-memory sink whose reads fail while ``down`` (a Redis that went away)."""

    def __init__(self) -> None:
        self.records: dict[int, HeartbeatRecord] = {}
        self.down = False

    def publish(self, record: HeartbeatRecord) -> None:
        self.records[record.rank] = record

    def read_all(self, world_size: int, started_after: float | None = None) -> dict[int, HeartbeatRecord]:
        if self.down:
            raise ConnectionError("Connection refused")
        return dict(self.records)

    def close(self) -> None:
        pass


def test_watcher_verdicts_from_records(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path)
    now = time.time()
    def publish(rank: int, step: int, phase: str, silent: float, stalled: float, warm: bool = True) -> None:
        sink.publish(HeartbeatRecord(rank, step=step, phase=phase, timestamp=now - silent,
                                     step_since=now - stalled, first_step_done=warm))

    publish(0, 5, "forward", 0, 0)  # fine
    publish(1, 5, "forward", 9, 9)  # silent: dead
    publish(2, 4, "collective", 0, 9)  # beating, step frozen: hung
    publish(3, 0, "init", 0, 9)  # compiling
    publish(4, 9, "done", 99, 99)  # finished
    publish(5, 7, "forward", 0, 9, warm=False)  # first step after a restore: still warming up
    watcher = HeartbeatWatcher(sink, world_size=7, timeout_s=5.0, init_timeout_s=60.0, since=0)
    result = watcher.check()
    assert (result.dead, result.hung, result.missing) == ([1], [2], [])
    assert not result.ok and result.faulty == [1, 2]
    watcher.started_at -= 61  # rank 6 never appeared within the init grace
    assert watcher.check().missing == [6]
    publish(5, 7, "forward", 0, 61, warm=False)  # ... but not forever
    assert watcher.check().hung == [2, 5]
    text = result.message()
    assert "dead=[1]" in text and "collective" in text


def _stall_case(phases: dict[int, str], frozen_s: float, steps_s: list[float] | None = (0.1, 0.1, 0.2),
                in_phase_s: float | None = None):
    """A watcher with the stall rule on (20 x median step, at least 5 s; timeout 30 s) over ranks
    in ``phases`` whose step has been frozen ``frozen_s`` (in its phase ``in_phase_s``, default
    the same); returns its hung ranks and notes."""
    sink = _FlakySink()
    now = time.time()
    in_phase_s = frozen_s if in_phase_s is None else in_phase_s
    for rank, phase in phases.items():
        sink.publish(HeartbeatRecord(rank, step=40, phase=phase, timestamp=now, step_since=now - frozen_s,
                                     phase_since=now - in_phase_s, first_step_done=True,
                                     recent_step_s=list(steps_s) if steps_s else None))
    watcher = HeartbeatWatcher(sink, world_size=len(phases), timeout_s=30.0, since=0,
                               stall_factor=20.0, stall_min_s=5.0)
    result = watcher.check()
    return result.hung, result.notes


def test_a_rank_that_stopped_beating_with_its_step_is_frozen_and_its_peers_wait_for_it(tmp_path: Path) -> None:
    """SIGSTOP (or a debugger) stops a whole process: its heartbeat thread goes silent with its
    step. It alone is to blame; the ranks still beating are waiting for it in the collective."""
    sink = DirectorySink(tmp_path)
    now = time.time()
    steps = [0.1, 0.1, 0.1]  # steps of 0.1 s: the stall rule's limit is its 5 s floor
    sink.publish(HeartbeatRecord(0, step=7, phase="collective", timestamp=now, step_since=now - 8,
                                 first_step_done=True, recent_step_s=steps))
    sink.publish(HeartbeatRecord(1, step=7, phase="forward", timestamp=now - 7.5, step_since=now - 8,
                                 first_step_done=True, recent_step_s=steps))
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=60.0, since=0, stall_factor=20.0, stall_min_s=5.0)
    result = watcher.check()
    assert (result.frozen, result.waiting, result.hung) == ([1], [0], [])
    assert result.faulty == [1] and not result.ok
    assert "frozen=[1]" in result.headline() and "waiting=[0]" in result.headline()
    assert result.status(0) == "waiting" and result.status(1) == "frozen"
    # a rank whose heartbeat is only a beat late is no frozen rank: both are hung as before
    sink.publish(HeartbeatRecord(1, step=7, phase="forward", timestamp=now - 0.4, step_since=now - 8,
                                 first_step_done=True, recent_step_s=steps))
    result = watcher.check()
    assert (result.frozen, result.waiting, result.hung) == ([], [], [0, 1])


def test_a_frozen_step_of_short_steps_is_hung_long_before_the_timeout() -> None:
    # a rank hung in forward, its peer waiting in the gradients' all-reduce: 6 s >> 20 x 0.1 s
    hung, notes = _stall_case({0: "forward", 1: "backward"}, frozen_s=6.0)
    assert hung == [0, 1]
    assert "stuck 6.0 s in forward, over the stall limit 5.0 s" in notes[0] and "before the 30 s timeout" in notes[0]
    # never sooner than stall_min_s, however short the steps
    assert _stall_case({0: "forward", 1: "collective"}, frozen_s=4.0)[0] == []
    # the limit scales with the step: 20 x 0.5 s = 10 s
    assert _stall_case({0: "optimizer", 1: "backward"}, frozen_s=8.0, steps_s=[0.5, 0.5])[0] == []
    assert _stall_case({0: "optimizer", 1: "backward"}, frozen_s=11.0, steps_s=[0.5, 0.5])[0] == [0, 1]


def test_a_peer_stuck_in_the_same_step_just_under_the_limit_hangs_with_the_rank_over_it() -> None:
    """CI once saw the waiting rank cross the limit a few milliseconds before the rank that hung:
    the verdict named only the waiter. Every rank stuck mid-step in that step is hung with it."""
    sink = _FlakySink()
    now = time.time()
    steps = [0.1, 0.1, 0.1]  # the limit is the 5 s floor
    for rank, phase, stuck in [(0, "backward", 5.05), (1, "forward", 4.99), (2, "forward", 1.0)]:
        sink.publish(HeartbeatRecord(rank, step=4, phase=phase, timestamp=now, step_since=now - stuck,
                                     phase_since=now - stuck, first_step_done=True, recent_step_s=steps))
    sink.publish(HeartbeatRecord(3, step=3, phase="forward", timestamp=now, step_since=now - 4.9,
                                 phase_since=now - 4.9, first_step_done=True, recent_step_s=steps))
    result = HeartbeatWatcher(sink, world_size=4, timeout_s=60.0, since=0, stall_factor=20.0, stall_min_s=5.0).check()
    # rank 2 only just entered its phase (not stuck half the limit), rank 3 is in another step
    assert result.hung == [0, 1]
    assert "rank 0: step 5 stuck 5.1 s in backward, over the stall limit 5.0 s" in result.notes[0]
    assert "rank 1: step 5 stuck 5.0 s in forward, with a peer over the stall limit 5.0 s" in result.notes[1]


def test_the_stall_counts_from_the_last_phase_change_not_from_a_long_save_before_the_step() -> None:
    # step 40 ended 20 s ago, then a 19 s save or evaluation; the ranks are 1 s into the next step
    assert _stall_case({0: "forward", 1: "backward"}, frozen_s=20.0, in_phase_s=1.0)[0] == []
    assert _stall_case({0: "forward", 1: "backward"}, frozen_s=26.0, in_phase_s=6.0)[0] == [0, 1]
    # the timeout still counts from the step: 31 s without a step is hung whatever the phase did
    assert _stall_case({0: "forward", 1: "backward"}, frozen_s=31.0, in_phase_s=1.0)[0] == [0, 1]


@pytest.mark.parametrize("slow_phase", ["data", "checkpoint", "eval", "log", "init"])
def test_a_rank_in_a_phase_that_may_take_long_keeps_the_full_timeout_for_the_job(slow_phase: str) -> None:
    # one rank reads a shard, saves, evaluates or logs; its peer waits for it in a collective
    assert _stall_case({0: slow_phase, 1: "collective"}, frozen_s=20.0)[0] == []
    assert _stall_case({0: slow_phase, 1: "collective"}, frozen_s=31.0)[0] == [0, 1]


def test_the_stall_rule_needs_step_times_and_can_be_turned_off() -> None:
    assert _stall_case({0: "forward", 1: "backward"}, frozen_s=20.0, steps_s=None)[0] == []
    sink = _FlakySink()
    now = time.time()
    for rank in (0, 1):
        sink.publish(HeartbeatRecord(rank, step=40, phase="forward", timestamp=now, step_since=now - 20,
                                     first_step_done=True, recent_step_s=[0.1]))
    assert HeartbeatWatcher(sink, world_size=2, timeout_s=30.0, since=0, stall_factor=None).check().hung == []


def test_a_wait_on_another_process_past_its_deadline_is_a_hang_even_while_starting() -> None:
    """A rank restoring from a keeper that does not answer is in init (init_timeout_s 600 s): its
    record names the wait (megatrain/waits.py), and once the rank has waited past the wait's own
    deadline by more than the grace, it is hung, named by what it waits for."""
    sink, now = _FlakySink(), time.time()
    wait = {"what": "checkpoint keeper: list", "where": "/tmp/k/keeper.sock", "pid": 4242, "deadline_s": 5.0}
    sink.publish(HeartbeatRecord(0, phase="init", timestamp=now, step_since=now - 12, waits=[{**wait, "since": now - 12}]))
    sink.publish(HeartbeatRecord(1, phase="init", timestamp=now, step_since=now - 12, waits=[{**wait, "since": now - 3}]))
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=30.0, init_timeout_s=600.0, since=0)
    result = watcher.check()
    assert result.hung == [0], result.message()  # rank 1's wait is still within its deadline
    assert "waiting 12.0 s for checkpoint keeper: list at /tmp/k/keeper.sock (pid 4242), past its 5 s deadline" \
        in result.notes[0]
    assert "waiting 12.0 s for checkpoint keeper: list" in result.message()


def test_records_of_a_previous_attempt_are_ignored(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path)
    old = time.time() - 100  # attempt 1: rank 1 died long ago
    sink.publish(HeartbeatRecord(0, step=5, phase="done", timestamp=old, step_since=old))
    sink.publish(HeartbeatRecord(1, step=5, phase="forward", timestamp=old, step_since=old))
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=5.0, init_timeout_s=60.0)  # attempt 2
    assert watcher.check().ok and watcher.check().records == {}
    now = time.time()
    sink.publish(HeartbeatRecord(1, step=0, phase="init", timestamp=now, step_since=now))
    assert list(watcher.check().records) == [1]
    watcher.started_at -= 61
    assert watcher.check().missing == [0]  # its "done" was the previous attempt's


def test_watcher_has_no_verdict_while_the_store_is_down_and_a_grace_after():
    sink = _FlakySink()
    watcher = HeartbeatWatcher(sink, 1, timeout_s=0.3, since=0)
    sink.publish(HeartbeatRecord(rank=0, step=3, phase="forward", timestamp=time.time(), step_since=time.time(),
                                 first_step_done=True))
    assert watcher.check().ok
    sink.down = True
    first = watcher.check()
    assert first.ok and first.unknown and "unreadable" in first.notes[0]
    time.sleep(0.4)  # longer than the timeout: still no verdict, nothing is known
    later = watcher.check()
    assert later.ok and later.unknown and not later.notes
    sink.down, sink.records = False, {}  # back, but empty (a restarted Redis)
    back = watcher.check()
    assert back.ok and back.unknown is None and "readable again" in back.notes[0]
    time.sleep(0.15)
    assert watcher.check().ok  # within the grace that started when the store came back
    time.sleep(0.25)
    assert watcher.check().dead == [0]  # never heard again: dead, a full timeout after the store returned


def test_watcher_reports_a_rank_whose_forward_time_stays_above_its_peers():
    sink = _FlakySink()
    watcher = HeartbeatWatcher(sink, 2, timeout_s=30, since=0, slow_factor=0.5, slow_steps=3)
    notes = []
    history: dict[int, list[list[float]]] = {0: [], 1: []}
    for step in range(1, 6):
        now = time.time()
        for rank, forward in ((0, 0.10), (1, 0.10 if step < 2 else 0.25)):
            history[rank] = [*history[rank], [step, forward]][-8:]
            sink.publish(HeartbeatRecord(rank=rank, step=step, phase="backward", timestamp=now, step_since=now,
                                         first_step_done=True, recent_forward_s=history[rank]))
        if step % 2:  # polled at steps 1, 3 and 5 only: the records' history fills the gaps
            result = watcher.check()
            notes += result.notes
            assert result.ok  # slow is reported, never a fault
    assert result.slow == [1] and len(notes) == 1 and "rank 1 is slow: forward 2.50x" in notes[0]


CHILD = textwrap.dedent(
    """
    import sys, time
    from megatrain.reliability.heartbeat import DirectorySink, HeartbeatWriter, RedisSink
    import os
    from megatrain.reliability.identity import Identity
    kind, where, run_id, rank, mode, stacks = sys.argv[1:]
    token = os.environ.get("MEGATRAIN_RUN_TOKEN")  # set: records signed, as the launcher's ranks sign them
    identity = Identity(run_id, token) if token else None
    sink = RedisSink(where, run_id, identity=identity) if kind == "redis" else DirectorySink(where, identity=identity)
    writer = HeartbeatWriter(sink, int(rank), interval_s=0.2, stacks_dir=stacks)

    def stuck_in_allreduce(until=lambda: False):
        while not until():
            time.sleep(0.01 if mode == "peer" else 1)

    def peer_at(step):  # "peer": a collective with rank 1, which writes its step to a file
        try:
            return int(open(stacks + "/progress").read() or 0) >= step
        except (OSError, ValueError):
            return False

    for step in range(1, 10**9):
        writer.beat(step=step, phase="forward", loss=1.0 / step)
        time.sleep(0.02)
        writer.beat(phase="backward")
        time.sleep(0.02)
        if mode == "hang" and step == 10:
            writer.beat(phase="collective")
            stuck_in_allreduce()
        if mode == "peer":
            writer.beat(phase="collective")
            stuck_in_allreduce(lambda: peer_at(step))
        if mode == "lead":
            with open(stacks + "/progress.tmp", "w") as out:
                out.write(str(step))
            import os
            os.replace(stacks + "/progress.tmp", stacks + "/progress")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "redis"])
def test_watcher_finds_killed_and_hung_ranks(kind: str, tmp_path: Path, redis_url: str, run_id: str) -> None:
    timeout, interval = 1.0, 0.2
    where = redis_url if kind == "redis" else str(tmp_path / "hb")
    stacks = tmp_path / "stacks"
    sink = make(kind, tmp_path, redis_url, run_id)
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=timeout, init_timeout_s=30.0, stacks_dir=stacks)
    unsigned = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_RUN_TOKEN"}  # as this test's sink reads
    procs = {
        rank: subprocess.Popen([sys.executable, "-c", CHILD, kind, where, run_id, str(rank), mode, str(stacks)],
                               env=unsigned)
        for rank, mode in ((0, "run"), (1, "hang"))
    }
    try:
        records = wait_for(lambda: (r := sink.read_all(2)) and len(r) == 2 and r[0].step > 5
                           and r[1].phase == "collective" and r, timeout_s=60)  # start-up on a busy machine
        frozen_since = records[1].step_since
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.time()
        dead_at = hung_at = None
        poll_gap, polled_at = 0.0, time.time()  # this test's own delays between looks (a busy machine)
        while dead_at is None or hung_at is None:
            result = watcher.check()
            poll_gap, polled_at = max(poll_gap, time.time() - polled_at), time.time()
            assert 1 not in result.dead, "a hung rank's heartbeat thread keeps it alive"
            if 0 in result.dead and dead_at is None:
                dead_at = time.time()
            if 1 in result.hung and hung_at is None:
                hung_at = time.time()
            assert time.time() - killed_at < 10, result.message()
            time.sleep(0.05)
        # Flagged no earlier than the timeout after the last record, and at most one look later
        # (the record was fresh when the rank was killed: it beat until then).
        last_beat = result.records[0].timestamp
        assert killed_at - last_beat <= interval + poll_gap + 0.3, (killed_at - last_beat, poll_gap)
        assert timeout <= dead_at - last_beat <= timeout + poll_gap + 0.3, (dead_at - last_beat, poll_gap)
        assert hung_at - frozen_since >= timeout
        assert hung_at <= max(frozen_since + timeout, killed_at) + interval + poll_gap + 0.3, poll_gap
        assert result.records[0].step > 5 and result.records[1].phase == "collective"

        stacks_text = watcher.collect_stacks(result)
        assert "stuck_in_allreduce" in stacks_text[1], stacks_text
        report = result.message(stacks_text)
        assert "stuck_in_allreduce" in report and "dead=[0]" in report and "hung=[1]" in report
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        watcher.close()


@pytest.mark.slow
@pytest.mark.parametrize("found_by", ["stall rule", "timeout"])
def test_a_sigstopped_rank_is_named_alone_and_the_stacks_come_from_its_peers(tmp_path: Path, found_by: str) -> None:
    """Rank 1 is stopped (SIGSTOP) while rank 0 waits in a collective: the verdict names rank 1
    frozen and rank 0 waiting; rank 0's stack is collected, rank 1's entry says it cannot answer.
    Also when the stall rule does not apply (a peer outside a step phase, as CI once saw) and the
    silence runs past the timeout: a stopped process on this host is frozen, not dead."""
    stacks = tmp_path / "stacks"
    sink = DirectorySink(tmp_path / "hb")
    by_stall = found_by == "stall rule"
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=60.0 if by_stall else 4.0, init_timeout_s=60.0,
                               stacks_dir=stacks, stall_factor=20.0 if by_stall else None, stall_min_s=3.0)
    stacks.mkdir()
    procs = {rank: subprocess.Popen([sys.executable, "-c", CHILD, "directory", str(tmp_path / "hb"), "run", str(rank),
                                     mode, str(stacks)]) for rank, mode in ((0, "peer"), (1, "lead"))}
    try:
        wait_for(lambda: (r := sink.read_all(2)) and len(r) == 2 and r[0].step > 12 and r[1].step > 12)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        result = watcher.check()
        while result.ok:
            assert time.time() - stopped_at < 20, result.message()
            time.sleep(0.1)
            result = watcher.check()
        assert (result.frozen, result.waiting, result.faulty) == ([1], [0], [1]), result.message()
        stacks_text = watcher.collect_stacks(result, result.faulty)
        assert "stuck_in_allreduce" in stacks_text[0], stacks_text  # the waiting rank answers
        assert "frozen" in stacks_text[1] and "state T: stopped by a signal" in stacks_text[1], stacks_text
        assert "frozen=[1]" in result.message(stacks_text) and "waiting=[0]" in result.message(stacks_text)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        watcher.close()


@pytest.mark.slow
@pytest.mark.parametrize("forged", ["unsigned", "wrong signature"])
def test_forged_records_flooding_the_run_dir_change_no_verdict(tmp_path: Path, forged: str) -> None:
    """Signed ranks, rank 1 stopped (SIGSTOP), and a forger writing records for both ranks into the
    run's heartbeat folder as fast as it can, from before the watcher's first read: the verdict is
    the same as without it (frozen=[1], waiting=[0], by the stall rule long before the timeout).
    Where a forged record took the place of a true one, the watcher lost the ranks' clocks: it
    called the hang at the timeout or named the beating rank frozen."""
    import json
    import os
    import threading

    from megatrain.reliability.identity import Identity

    hb, stacks = tmp_path / "hb", tmp_path / "stacks"
    stacks.mkdir()
    env = dict(os.environ, MEGATRAIN_RUN_TOKEN="the-runs-token")
    forger_identity = Identity("run", None if forged == "unsigned" else "a-guessed-token")
    stop = threading.Event()

    def forge() -> None:
        """Records for both ranks under every name a rank's record can have in the run's folder:
        the old plain name, the live writers' place with a newer writer (which would win the
        newest-record choice if it were admitted), and another place. Beside the live writers'
        files, never over them: a process that may replace the run's own files can silence a rank
        whatever the reader does (the watcher then reports the silence, believing nothing forged);
        what it must not do is make the watcher believe a record it wrote."""
        hb.mkdir(exist_ok=True)
        while not stop.is_set():
            now = time.time()
            places = {m.split(".")[1] for m in (p.name for p in hb.glob("rank*.*.*.json")) if m.count(".") == 3}
            for rank in (0, 1):
                record = forger_identity.stamp(HeartbeatRecord(rank, step=999, phase="forward", timestamp=now,
                                                               step_since=now, first_step_done=True,
                                                               recent_step_s=[0.05] * 8))
                names = [f"rank{rank:05d}.json", f"rank{rank:05d}.zz.{int(now * 1000)}-1.json",
                         *(f"rank{rank:05d}.{place}.{int(now * 1000)}-1.json" for place in places)]
                for name in names:
                    spare = hb / f".{name}.forged"
                    spare.write_text(json.dumps(record.to_dict()))
                    os.replace(spare, hb / name)
            for old in hb.glob("rank*.*.*-1.json"):  # the forger's writers of a moment ago: one file each
                if not old.name.endswith(f"{int(now * 1000)}-1.json"):
                    old.unlink(missing_ok=True)
            time.sleep(0.002)

    forger = threading.Thread(target=forge, name="forger", daemon=True)
    forger.start()
    procs = {rank: subprocess.Popen([sys.executable, "-c", CHILD, "directory", str(hb), "run", str(rank), mode,
                                     str(stacks)], env=env) for rank, mode in ((0, "peer"), (1, "lead"))}
    sink = DirectorySink(hb, identity=Identity("run", "the-runs-token"))
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=60.0, init_timeout_s=60.0, stacks_dir=stacks,
                               stall_factor=20.0, stall_min_s=3.0, since=0)
    try:
        deadline = time.time() + 60
        while not ((r := watcher.check().records) and len(r) == 2 and r[0].step > 12 and r[1].step > 12):
            assert time.time() < deadline, "the ranks' records never came through"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        result = watcher.check()
        while result.ok:
            assert time.time() - stopped_at < 30, result.message()  # the timeout is 60 s
            time.sleep(0.1)
            result = watcher.check()
        assert (result.frozen, result.waiting, result.faulty) == ([1], [0], [1]), result.message()
        assert all(record.step != 999 for record in result.records.values())
    finally:
        stop.set()
        forger.join()
        for proc in procs.values():
            proc.kill()
            proc.wait()
        watcher.close()
