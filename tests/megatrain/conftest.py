"""Fixtures for the engine's tests: the real trainer in child processes (one process, or N gloo ranks),
and a real redis-server on a free loopback port (the Redis store, heartbeats, leases).

The trainer's processes are forked from this test worker's warm fork server, as a flow's CPU
ranks are (megatrain/launch/forked.py): `megatrain train` as one process, ranks with torchrun's
environment. ``launcher="torchrun"`` starts fresh interpreters under torchrun instead, for the
tests of what torchrun itself reports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def train_command(nproc: int, config: Path, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megatrain.cli", "train", "--config", str(config), *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "megatrain.train", "--config", str(config), *overrides,
    ]


def run_forked(nproc: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``megatrain train ARGV`` (one process: stdout and stderr apart) or ``nproc`` ranks of
    ``megatrain.train ARGV`` (their lines together in both), forked from the warm server; the exit
    code is the process's, or the first failed rank's (torchrun's agent would say 1)."""
    from megatrain.launch.forked import ForkLaunch, run_module, run_to_end

    if nproc == 1:
        return run_module("megatrain.cli", ["train", *argv], child_env(), ROOT, timeout)
    code, output = run_to_end(ForkLaunch(argv, nproc), child_env(), ROOT, timeout)
    if code is None:
        raise subprocess.TimeoutExpired(["megatrain.train", *argv], timeout, output)
    return subprocess.CompletedProcess(["megatrain.train", *argv], code, output, output)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def run_training(tmp_path, shard_root):
    """Run the trainer and return (metrics rows, completed process). Paths go under tmp_path."""

    def run(overrides: list[str], nproc: int = 1, name: str = "run", config: Path = TINY, timeout: int = 600,
            check: bool = True, launcher: str = "fork"):
        run_dir = tmp_path / name
        paths = [
            f"train.run_dir={run_dir}", f"data.shard_url={shard_root}",
            f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/checkpoints",
        ]
        if launcher == "torchrun":
            proc = subprocess.run(
                train_command(nproc, config, paths + overrides), cwd=ROOT, env=child_env(),
                capture_output=True, text=True, timeout=timeout,
            )
        else:
            proc = run_forked(nproc, ["--config", str(config), *paths, *overrides], timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        metrics = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        return metrics, proc

    return run


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, process) of a throwaway redis-server: no persistence, loopback only."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: make services (apt-get install -y redis-server)")
    from megatrain.reliability.redis_server import start_redis_server

    proc = start_redis_server()  # a free port, taken again if another process wins it first
    yield f"redis://127.0.0.1:{proc.port}/0", proc
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(redis_server: tuple[str, subprocess.Popen]) -> str:
    return redis_server[0]


@pytest.fixture
def run_id() -> str:
    """A fresh key namespace per test, so tests sharing the server never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"
