"""Runs of the hosts launcher with its watch (python -m megatrain.reliability.host_watch) for the tests of
a lost host: shrink on the survivors, fencing of a partitioned host's stale ranks. Their durable store
is the storage host's S3 (``durable_url``), as a cluster's is; nothing of it is a shared folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatrain.launch.cluster_services import BUCKET
from megatrain.launch.nodes import cluster_endpoints, cluster_redis_password, cluster_s3_env
from megatrain.launch.run_token import RUN_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/tiny-cpu.yaml"


def shards(shared_dir: Path, shard_url: str) -> Path:
    target = shared_dir / "shards"  # the cluster's shared volume: the session's shards live in this /tmp only
    if not target.exists():
        shutil.copytree(shard_url, target)
    return target


def overrides(shared_dir: Path, run_dir: Path, steps: int, interval: int) -> list[str]:
    return ["model.n_layer=1", f"train.steps={steps}", f"checkpoint.interval={interval}", "checkpoint.keep_last=100",
            "data.max_source_bytes=300000", f"data.shard_url={shared_dir / 'shards'}", "train.micro_batch_size=4",
            "train.log_interval=1", "data.prefetch_batches=0", f"train.run_dir={run_dir}",
            f"checkpoint.durable_url={durable_url(run_dir)}", "reliability.heartbeat_interval_s=0.5",
            "reliability.heartbeat_timeout_s=3", "checkpoint.upload_backoff_s=0.5"]


def durable_url(run_dir: Path) -> str:
    """The run's checkpoints on the storage host's S3: ``s3://megatrain/<session folder>/<run>`` (the
    session's shared folder has a fresh name, so runs of two sessions on one cluster never meet)."""
    return f"s3://{BUCKET}/{run_dir.parent.name}/{run_dir.name}"


def use_s3(cluster, monkeypatch) -> None:
    """This process reads the cluster's S3 as its ranks do: the storage host's endpoint, moto's keys."""
    for key, value in cluster_s3_env(cluster).items():
        monkeypatch.setenv(key, value)


def manifests(run_dir: Path) -> dict[int, dict]:
    """step -> manifest of every committed checkpoint of the run, read back from S3."""
    from megatrain.checkpoint import catalog

    return {info.step: info.manifest for info in catalog.committed(durable_url(run_dir))}


def step_url(run_dir: Path, step: int) -> str:
    return f"{durable_url(run_dir)}/step-{step:08d}"


def copy_step(source: str, target: str) -> None:
    """A step's objects copied inside S3 (server side), the manifest last: the copy is committed once whole."""
    from megatrain import storage

    fs, _ = storage.resolve(source)
    names = sorted(storage.find(source), key=lambda url: url.endswith("/manifest.json"))
    for url in names:
        fs.copy(url, target + url[len(source):])


def launch(cluster, run_dir: Path, nodes: str, args: list[str], faults: list[dict] | None = None,
           module: str = "megatrain.reliability.host_watch") -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRAIN_FAULTS=json.dumps(faults or []),
               **{RUN_TOKEN_ENV: f"token-{run_dir.name}-0123456789ab"})
    extra = ["--backend", "hosts"] if module == "megatrain.launch.nodes" else []
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", module, *extra, "--cluster", cluster.name, "--config", CONFIG,
                           "--nodes-dir", str(run_dir / "nodes"), "--nodes", nodes, "--nproc-per-node", "1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last attempt's where a step was trained twice."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def redis_env(cluster) -> dict[str, str]:
    """What a process needs to reach the cluster's Redis: the URL and its password."""
    return {"url": cluster_endpoints(cluster)["redis"] + "/0", "password": cluster_redis_password(cluster)}
