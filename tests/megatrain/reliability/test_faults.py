"""Fault injection: each hook fires on its step and rank, once=True faults fire in one attempt
only, and the process-level faults (kill, hang, kill_redis) really happen."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest
import torch

from megatrain.config import FaultConfig, ReliabilityConfig
from megatrain.reliability.faults import (
    FAULTS_ENV,
    FaultInjector,
    StorageOutage,
    corrupt_checkpoint,
    faults_from_env,
    kill_redis,
)


def test_loss_faults_fire_on_their_step_and_rank_once(tmp_path: Path) -> None:
    faults = [FaultConfig(kind="nan_loss", step=3, rank=1), FaultConfig(kind="spike_loss", step=5, rank=1, magnitude=4)]
    other_rank = FaultInjector(faults, rank=0, run_dir=tmp_path)
    injector = FaultInjector(faults, rank=1, run_dir=tmp_path)
    assert not other_rank.enabled and injector.enabled
    out = {step: injector.transform_loss(step, 2.0) for step in range(8)}
    assert math.isnan(out[3]) and out[5] == 8.0
    assert all(out[s] == 2.0 for s in (0, 1, 2, 4, 6, 7))
    assert [other_rank.transform_loss(s, 2.0) for s in range(8)] == [2.0] * 8
    assert injector.fired == [(3, "nan_loss"), (5, "spike_loss")]
    # a tensor loss keeps its graph
    w = torch.ones(2, requires_grad=True)
    again = FaultInjector([FaultConfig(kind="spike_loss", step=0, once=False, magnitude=3)], 0, tmp_path)
    loss = again.transform_loss(0, w.sum())
    loss.backward()
    assert loss.item() == 6.0 and w.grad.tolist() == [3.0, 3.0]
    # the restarted attempt (a new injector, same run_dir) runs clean
    restarted = FaultInjector(faults, rank=1, run_dir=tmp_path)
    assert [restarted.transform_loss(s, 2.0) for s in range(8)] == [2.0] * 8 and restarted.fired == []
    # without once, it fires every attempt
    repeat = [FaultConfig(kind="nan_loss", step=1, once=False)]
    for _ in range(2):
        assert math.isnan(FaultInjector(repeat, 0, tmp_path).transform_loss(1, 1.0))


def test_slow_rank_sleeps_a_fraction_of_the_step(tmp_path: Path) -> None:
    injector = FaultInjector([FaultConfig(kind="slow_rank", step=2, slowdown=1.0)], 0, tmp_path)
    durations = []
    for step in range(5):
        start = time.monotonic()
        injector.on_step_start(step)
        durations.append(time.monotonic() - start)
        time.sleep(0.05)  # the step's own work
    assert max(durations[:2]) < 0.02  # not yet
    assert all(0.04 < d < 0.2 for d in durations[2:])  # ~1.0 x 50 ms, on every later step
    assert [s for s, _ in injector.fired] == [2, 3, 4]
    assert FaultInjector(injector.faults, 0, tmp_path).fired == []  # next attempt: not claimed


def test_storage_outage(tmp_path: Path) -> None:
    injector = FaultInjector([FaultConfig(kind="storage_outage", step=1, duration_s=0.4)], 0, tmp_path)
    outage = StorageOutage(tmp_path)
    fs = outage.wrap(fsspec.filesystem("memory"))
    fs.pipe_file("/outage-test/a", b"x")
    injector.on_step_start(0)
    assert not outage.active()
    injector.on_step_start(1)
    assert outage.active()
    with pytest.raises(ConnectionError, match="injected storage outage"):
        fs.cat_file("/outage-test/a")
    assert fs.protocol == fsspec.filesystem("memory").protocol  # attributes pass through
    time.sleep(0.45)
    assert fs.cat_file("/outage-test/a") == b"x"


def test_corruption(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    weights = bytes(range(256)) * 64
    (ckpt / "model.bin").write_bytes(weights)
    hit = corrupt_checkpoint(str(ckpt))
    assert hit.endswith("model.bin")
    after = (ckpt / "model.bin").read_bytes()
    assert len(after) == len(weights) and after != weights and (ckpt / "manifest.json").read_text() == "{}"

    shard = tmp_path / "shard-000.tar"
    shard.write_bytes(b"a" * 1000)
    injector = FaultInjector([FaultConfig(kind="corrupt_shard", step=2, target=str(shard))], 0, tmp_path)
    injector.on_step_start(1)
    assert shard.read_bytes() == b"a" * 1000
    injector.on_step_start(2)
    assert shard.read_bytes() != b"a" * 1000
    with pytest.raises(ValueError, match="target"):
        FaultInjector([FaultConfig(kind="corrupt_checkpoint")], 0, tmp_path)


def test_faults_from_env(tmp_path: Path) -> None:
    env = {FAULTS_ENV: json.dumps([{"kind": "kill_rank", "step": 4, "rank": 1}])}
    assert faults_from_env(env) == [FaultConfig(kind="kill_rank", step=4, rank=1)]
    assert faults_from_env({}) == []
    injector = FaultInjector.from_config(ReliabilityConfig(faults=[FaultConfig(kind="nan_loss")]), 1, tmp_path, env)
    assert [f.kind for f in injector.faults] == ["kill_rank"]  # nan_loss is for rank 0
    with pytest.raises(ValueError, match=FAULTS_ENV):
        faults_from_env({FAULTS_ENV: '[{"kind": "meteor"}]'})


CHILD = textwrap.dedent(
    """
    import json, sys
    from megatrain.config import FaultConfig
    from megatrain.reliability.faults import FaultInjector
    run_dir, faults = sys.argv[1], [FaultConfig(**f) for f in json.loads(sys.argv[2])]
    injector = FaultInjector(faults, rank=0, run_dir=run_dir)
    for step in range(6):
        injector.on_step_start(step)
        print("step", step, flush=True)
    """
)


def run_child(run_dir: Path, faults: list[dict]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), json.dumps(faults)],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_rank_kills_the_process_once(tmp_path: Path) -> None:
    faults = [{"kind": "kill_rank", "step": 3}]
    first = run_child(tmp_path, faults)
    out, _ = first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert out.split("\n")[-2] == "step 2"
    second = run_child(tmp_path, faults)  # the restart passes step 3
    out, _ = second.communicate(timeout=30)
    assert second.returncode == 0 and "step 5" in out


@pytest.mark.slow
def test_hang_rank_hangs(tmp_path: Path) -> None:
    child = run_child(tmp_path, [{"kind": "hang_rank", "step": 1}])
    try:
        assert child.stdout.readline() == "step 0\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)
        assert list((tmp_path / "faults").glob("fired-hang_rank-*.json"))
    finally:
        child.kill()
        child.wait()


def test_kill_redis(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    pidfile = tmp_path / "redis.pid"
    import socket

    from megatrain.reliability.redis_server import start_redis_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = start_redis_server(port)  # really up, so the SIGKILL below is what ends it
    pidfile.write_text(f"{proc.pid}\n")
    injector = FaultInjector([FaultConfig(kind="kill_redis", step=0, target=str(pidfile))], 0, tmp_path)
    injector.on_step_start(0)
    assert proc.wait(timeout=5) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        kill_redis(proc.pid)
    assert not os.path.exists(f"/proc/{proc.pid}/status")
