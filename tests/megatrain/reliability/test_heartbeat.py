"""Heartbeats, the writer side: round trips through both sinks, the sink a config picks, and
the per-phase seconds a record carries for the watcher's straggler check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from heartbeat_helpers import make, wait_for

from megatrain.config import ReliabilityConfig
from megatrain.reliability.heartbeat import DirectorySink, HeartbeatRecord, HeartbeatWriter, RedisSink, make_sink


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


def test_writer_publishes_the_seconds_of_each_phase_of_the_last_step(tmp_path):
    writer = HeartbeatWriter(DirectorySink(tmp_path), 0, interval_s=0.05)
    try:
        writer.beat(step=0, phase="data")  # restored step, still "init": no step finished yet
        for step in (1, 2, 3):
            writer.beat(phase="forward")
            time.sleep(0.06 * step)
            writer.beat(phase="backward")
            time.sleep(0.02)
            writer.beat(step=step, phase="checkpoint")
        saved = writer.record
        time.sleep(0.02)
        writer.beat(phase="forward")  # the next step begins: progress, though the step is the same
        record = writer.record
    finally:
        writer.close()
    assert saved.phase_since == saved.step_since and record.phase_since >= record.step_since + 0.015
    phases = record.step_phase_s
    assert 0.17 <= phases["forward"] < 0.4 and 0.015 <= phases["backward"] < 0.2, phases
    assert [step for step, _ in record.recent_forward_s] == [1, 2, 3]
    assert record.recent_forward_s[2][1] == phases["forward"]
    # step to step (the watcher's stall scale) from the second step on: the first is the warm-up's
    second, third = record.recent_step_s
    assert 0.135 <= second < 0.4 and 0.195 <= third < 0.5 and third > second, record.recent_step_s
