"""The start-up breakdown: phases timed in order, the heartbeat told, and on the first step
``startup.json`` plus the breakdown in that step's metrics.jsonl row."""

from __future__ import annotations

import json
import time

import pytest

from megatrain.report.runs import read_metrics
from megatrain.observe.startup import PHASES, StartupTimer, read_startup


def test_phases_listeners_and_first_step_record(tmp_path) -> None:
    timer = StartupTimer(rank=0, started_at=time.time() - 1.0)
    seen: list[str | None] = []
    timer.on_phase(seen.append)
    with timer.phase("rendezvous"):
        time.sleep(0.05)
    with timer.phase("rendezvous"):  # a retried rendezvous adds up
        time.sleep(0.05)
    with timer.phase("model"):
        pass
    with pytest.raises(ValueError, match="start-up phase 'dinner'"):
        with timer.phase("dinner"):
            pass

    class Store:
        ops = {"add": 1, "compare_set": 1}

    timer.watch_store(Store())
    step_start = time.perf_counter()
    time.sleep(0.05)  # the first step
    step_s = time.perf_counter() - step_start
    summary = timer.first_step(step_s, tmp_path, step=7)
    assert timer.first_step(9.0, tmp_path, step=8) is None  # only once per process

    assert seen == ["rendezvous", "rendezvous", "model", None]
    assert summary["phases_s"]["rendezvous"] >= 0.1 and summary["phases_s"]["first_step"] == round(step_s, 4)
    assert summary["phases_s"]["imports"] >= 1.0
    assert summary["to_first_step_s"] >= sum(summary["phases_s"].values()) - 1e-3
    assert summary["first_step_at"] - summary["started_at"] == pytest.approx(summary["to_first_step_s"], abs=2e-3)
    assert summary["store_ops"] == {"add": 1, "compare_set": 1} and summary["step"] == 7
    assert read_startup(tmp_path) == summary


@pytest.mark.slow
def test_a_real_run_writes_its_breakdown(tmp_path) -> None:
    """One process, one step through ``megatrain.train``: every phase up to the first step."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.train", "--config", "configs/tiny-cpu.yaml", "train.steps=1",
         f"train.run_dir={tmp_path}", f"checkpoint.staging_dir={tmp_path}/staging",
         f"checkpoint.durable_url={tmp_path}/durable"],
        cwd=root, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    startup = read_startup(tmp_path)
    assert list(startup["phases_s"]) == list(PHASES)  # all of them, in order
    assert startup["step"] == 1 and startup["store_ops"]["compare_set"] == 1
    assert "start-up:" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["startup"] == startup  # in the first step's row
    assert read_metrics(tmp_path)[0]["loss"] == rows[0]["loss"]


def test_heartbeat_shows_the_start_up_phase(tmp_path) -> None:
    """A rank stuck while starting shows where: the heartbeat record carries the phase."""
    from megatrain.reliability.heartbeat import DirectorySink, HeartbeatWriter

    writer = HeartbeatWriter(DirectorySink(tmp_path / "hb"), rank=0, interval_s=0.05)
    timer = StartupTimer(rank=1)
    timer.on_phase(writer.set_init_phase)
    try:
        with timer.phase("engine"):
            assert writer.record.init_phase == "engine"
            deadline = time.time() + 10
            while DirectorySink(tmp_path / "hb").read_all(1).get(0, None) is None or \
                    DirectorySink(tmp_path / "hb").read_all(1)[0].init_phase != "engine":
                assert time.time() < deadline, "the published record never showed the phase"
                time.sleep(0.02)
        timer.first_step(0.1, tmp_path, step=1)  # rank 1 writes no files
        assert writer.record.init_phase is None
        assert not (tmp_path / "startup.json").exists()
    finally:
        writer.close()
