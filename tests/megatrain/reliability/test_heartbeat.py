"""Heartbeats: round trips through both sinks, and a watcher that tells a killed process
(silent) from a hung one (beating, step frozen) and fetches the hung one's stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatrain.config import ReliabilityConfig
from megatrain.reliability.heartbeat import (
    DirectorySink,
    HeartbeatRecord,
    HeartbeatSink,
    HeartbeatWatcher,
    HeartbeatWriter,
    RedisSink,
    make_sink,
)


def make(kind: str, tmp_path: Path, redis_url: str, run_id: str) -> HeartbeatSink:
    return RedisSink(redis_url, run_id) if kind == "redis" else DirectorySink(tmp_path / "hb")


def wait_for(predicate, timeout_s: float = 10.0, poll_s: float = 0.02):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("kind", ["directory", "redis"])
def test_round_trip(kind: str, tmp_path: Path, redis_url: str, run_id: str) -> None:
    sink = make(kind, tmp_path, redis_url, run_id)
    writer = HeartbeatWriter(sink, rank=3, interval_s=0.1, dp_rank=1, tp_rank=1, pp_rank=0)
    writer.beat(step=6, phase="data")  # restored from a checkpoint while in init: not progress
    assert not writer.record.first_step_done
    writer.beat(step=7, phase="forward", loss=2.5, tokens_per_s=1234.0, straggler=True)
    assert writer.record.first_step_done
    got = wait_for(lambda: sink.read_all(4).get(3) if sink.read_all(4).get(3, HeartbeatRecord(3)).step == 7 else None)
    assert (got.rank, got.step, got.phase, got.loss, got.tokens_per_s) == (3, 7, "forward", 2.5, 1234.0)
    assert (got.dp_rank, got.tp_rank, got.pp_rank, got.straggler, got.pid) == (1, 1, 0, True, os.getpid())
    assert set(sink.read_all(4)) == {3}
    with writer.phase("collective"):
        wait_for(lambda: sink.read_all(4)[3].phase == "collective")
    writer.close()
    assert sink.read_all(4)[3].phase == "done"
    with pytest.raises(ValueError, match="phase"):
        writer.beat(phase="lunch")
    sink.close()


def test_make_sink(tmp_path: Path, redis_url: str) -> None:
    assert isinstance(make_sink(ReliabilityConfig(), tmp_path, "r"), DirectorySink)
    assert isinstance(make_sink(ReliabilityConfig(redis_url=redis_url), tmp_path, "r"), RedisSink)


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


CHILD = textwrap.dedent(
    """
    import sys, time
    from megatrain.reliability.heartbeat import DirectorySink, HeartbeatWriter, RedisSink
    kind, where, run_id, rank, mode, stacks = sys.argv[1:]
    sink = RedisSink(where, run_id) if kind == "redis" else DirectorySink(where)
    writer = HeartbeatWriter(sink, int(rank), interval_s=0.2, stacks_dir=stacks)

    def stuck_in_allreduce():
        while True:
            time.sleep(1)

    for step in range(1, 10**9):
        writer.beat(step=step, phase="forward", loss=1.0 / step)
        time.sleep(0.02)
        writer.beat(phase="backward")
        time.sleep(0.02)
        if mode == "hang" and step == 10:
            writer.beat(phase="collective")
            stuck_in_allreduce()
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
    procs = {
        rank: subprocess.Popen([sys.executable, "-c", CHILD, kind, where, run_id, str(rank), mode, str(stacks)])
        for rank, mode in ((0, "run"), (1, "hang"))
    }
    try:
        records = wait_for(lambda: (r := sink.read_all(2)) and len(r) == 2 and r[0].step > 5
                           and r[1].phase == "collective" and r)
        frozen_since = records[1].step_since
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.time()
        dead_at = hung_at = None
        while dead_at is None or hung_at is None:
            result = watcher.check()
            assert 1 not in result.dead, "a hung rank's heartbeat thread keeps it alive"
            if 0 in result.dead and dead_at is None:
                dead_at = time.time()
            if 1 in result.hung and hung_at is None:
                hung_at = time.time()
            assert time.time() - killed_at < 10, result.message()
            time.sleep(0.05)
        # Flagged no earlier than the timeout allows, and at most one interval (+ polling) later.
        assert timeout - interval <= dead_at - killed_at <= timeout + interval + 0.3
        assert hung_at - frozen_since >= timeout
        assert hung_at <= max(frozen_since + timeout, killed_at) + interval + 0.3
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
