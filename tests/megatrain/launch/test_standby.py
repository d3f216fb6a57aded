"""Warm standby: a real 2-rank gloo job whose rank 1 is killed, restarted from the standby set that
imported while the first attempt ran, then trained to the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatrain.launch import standby
from megatrain.launch.ranks import run_ranks
from megatrain.reliability.heartbeat import DirectorySink
from megatrain.reliability.watcher import HeartbeatWatcher
from megatrain.launch.standby import StandbyLaunch, standby_key

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_a_crashed_attempt_restarts_from_the_warm_standby(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    fault = [{"kind": "kill_rank", "rank": 1, "step": 8}]
    launch = StandbyLaunch(["--config", "configs/tiny-cpu.yaml", "model.n_layer=1",
                            "train.micro_batch_size=2", "train.global_batch_size=4", "data.max_source_bytes=200000",
                            "train.steps=10", "reliability.heartbeat_interval_s=0.2",
                            f"train.run_dir={tmp_path}", f"checkpoint.staging_dir={tmp_path}/staging",
                            f"checkpoint.durable_url={tmp_path}/durable", "checkpoint.interval=2",
                            "reliability.faults=" + json.dumps(fault)], nproc_per_node=2)
    lines: list[str] = []
    key = standby_key(2, env, ROOT)

    # the watcher tells the launcher when every rank has trained a step: then the next set starts
    watcher = HeartbeatWatcher(DirectorySink(tmp_path / "heartbeats"), 2, timeout_s=60, init_timeout_s=300)
    first = run_ranks(launch, on_line=lines.append, watcher=watcher, env=env, cwd=ROOT, poll_s=0.2, timeout_s=600)
    assert first.status == "crashed", "\n".join(lines[-40:])
    assert first.root_cause["rank"] == 1 and first.root_cause["signal"] == "SIGKILL"  # rank 0's gloo error is not the cause
    waiting = standby._WAITING[key]  # prepared during the attempt, still waiting
    assert waiting.alive()
    assert waiting.wait_ready(300)  # (a fault in the first steps can come before the imports finish)
    pids = [p.pid for p in waiting.procs]

    lines.clear()
    second = run_ranks(launch, on_line=lines.append, env=env, cwd=ROOT, poll_s=0.2, timeout_s=600)
    assert second.status == "completed", "\n".join(lines[-40:])
    startup = json.loads((tmp_path / "startup.json").read_text())
    records = DirectorySink(tmp_path / "heartbeats").read_all(2)
    assert sorted(r.pid for r in records.values()) == sorted(pids)  # the ranks were the standby's processes
    # imported before the hand-over: the imports phase is the hand-over's latency, not Python
    # importing torch and DeepSpeed (seconds)
    assert startup["phases_s"]["imports"] < 1.0, startup
    assert any("standby ready" in line for line in lines)
    assert all(os.path.exists(f"/proc/{pid}") is False or _zombie(pid) for pid in pids)  # they ended with the job
    assert key not in standby._WAITING  # a completed stage leaves no standby behind


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
