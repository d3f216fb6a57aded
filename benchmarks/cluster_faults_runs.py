"""The runs of benchmarks/cluster_faults.py: one short stage per host fault class on a fresh cluster of
``megatrain/launch/hosts.py`` (4 node hosts x 1 CPU rank, head, redis, storage), through the hosts
launcher with its watch (``python -m megatrain.reliability.host_watch``, ``on_node_loss: shrink``), and
what each left behind: the fault's marker, the watch's verdict, every metrics row with the wall
time it appeared (rows carry no clock of their own, so a thread tails ``metrics.jsonl``), and the
committed checkpoints. The durable store is the storage host's S3 (``s3://megatrain/<run>``, the
launcher hands the ranks its endpoint), so ``storage_host_down`` falls on the ranks' uploads and
commits; the manifests are read back from it before the cluster goes down (moto keeps them in memory).

Needs root (the cluster); imports neither torch nor prefect (the ranks do, in their hosts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny-cpu.yaml"
FAULT_NODE = 3  # not rank 0's host: the committer stays, as in most real losses

# kind -> the fault, fired at --fault-step; each class gets a cluster of its own (host_down removes a host)
FAULTS = {
    "host_down": {"kind": "host_down", "node": FAULT_NODE},
    "partition": {"kind": "partition", "node": FAULT_NODE, "duration_s": 8.0},
    "slow_link": {"kind": "slow_link", "node": FAULT_NODE, "rate": "20mbit"},
    "redis_host_down": {"kind": "redis_host_down", "duration_s": 4.0},
    "storage_host_down": {"kind": "storage_host_down", "duration_s": 4.0},
}


def overrides(run_dir: Path, shards: Path, steps: int, interval: int) -> list[str]:
    """12 samples a step: dp 4 x accumulation 3, after a shrink dp 3 x 4 (the same global batch)."""
    return ["model.n_layer=1", f"train.steps={steps}", f"checkpoint.interval={interval}", "checkpoint.keep_last=100",
            "data.max_source_bytes=300000", f"data.shard_url={shards}", "train.micro_batch_size=1",
            "train.global_batch_size=12", "train.log_interval=1", "data.prefetch_batches=0",
            f"train.run_dir={run_dir}", f"checkpoint.durable_url={durable_url(run_dir)}",
            "reliability.heartbeat_interval_s=0.5", "reliability.heartbeat_timeout_s=3",
            "checkpoint.upload_backoff_s=0.5", "reliability.on_node_loss=shrink", "reliability.max_restarts=1",
            "reliability.evict_slow_host_after_s=3"]


def durable_url(run_dir: Path) -> str:
    """The run's checkpoints on its cluster's S3 (each class has a cluster, and so a bucket, of its own)."""
    from megatrain.launch.cluster_services import BUCKET

    return f"s3://{BUCKET}/{run_dir.name}"


def committed(cluster, run_dir: Path) -> dict[int, dict]:
    """step -> epoch, world size and the time of the manifest's commit, read from the cluster's S3;
    ``{"error": ...}`` when it cannot be read."""
    from megatrain.checkpoint import catalog
    from megatrain.launch.nodes import cluster_s3_env

    saved = {key: os.environ.get(key) for key in cluster_s3_env(cluster)}
    os.environ.update(cluster_s3_env(cluster))
    try:
        return {info.step: {"epoch": info.manifest.get("epoch"), "world_size": info.manifest["layout"]["world_size"],
                            "committed_at": info.manifest.get("committed_at")}
                for info in catalog.committed(durable_url(run_dir))}
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Tail(threading.Thread):
    """(wall time, row) for every row of ``metrics.jsonl`` as it appears, polled every 50 ms."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.rows, self.stop = path, [], threading.Event()

    def run(self) -> None:
        offset = 0
        while not self.stop.is_set():
            self._read(offset_holder := [offset])
            offset = offset_holder[0]
            self.stop.wait(0.05)
        self._read([offset])

    def _read(self, offset: list[int]) -> None:
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(offset[0])
            while (line := handle.readline()).endswith("\n"):
                offset[0] = handle.tell()
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "step" in row and "loss" in row:
                    self.rows.append((time.time(), row))


def run_class(name: str | None, shards: Path, work: Path, steps: int, interval: int, fault_step: int,
              nodes: int = 4) -> dict:
    """One stage on a fresh cluster, ``name``'s fault at ``fault_step`` (None: fault-free). What it left."""
    from megatrain.launch import cluster_services, hosts
    from megatrain.launch.host_faults import marker

    run_dir = work / (name or "clean")
    fault = {**FAULTS[name], "step": fault_step} if name else None
    cluster, _ = cluster_services.up(nodes, services=True, owner_pid=os.getpid())
    tail = Tail(run_dir / "metrics.jsonl")
    tail.start()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRAIN_FAULTS=json.dumps([fault] if fault else []),
               MEGATRAIN_RUN_TOKEN=f"token-{run_dir.name}-0123456789ab")
    load_before, start = os.getloadavg(), time.time()
    try:
        done = subprocess.run([sys.executable, "-m", "megatrain.reliability.host_watch", "--cluster", cluster.name,
                               "--config", CONFIG, "--nodes-dir", str(run_dir / "nodes"),
                               "--nodes", ",".join(map(str, range(nodes))), "--nproc-per-node", "1",
                               *overrides(run_dir, shards, steps, interval)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        end = time.time()
        tail.stop.set()
        tail.join(timeout=5)
        if fault and fault["kind"] == "slow_link":
            cluster.clear_link(f"node{FAULT_NODE}")
        try:
            checkpoints = committed(cluster, run_dir)  # before the cluster, and its S3 in memory, goes
        finally:
            hosts.down(cluster.name)
    left = leftovers(cluster.name, run_dir)
    fired = marker(run_dir, fault["kind"], fault.get("node", 0)) if fault else None
    lost = run_dir / "faults" / "host-lost.json"
    (run_dir / "launcher.log").write_text(done.stdout + done.stderr)
    return {"name": name or "clean", "exit": done.returncode, "start": start, "end": end,
            "fault": json.loads(fired.read_text()) if fired and fired.exists() else None,
            "verdict": json.loads(lost.read_text()) if lost.exists() else None,
            "rows": [(t, {"step": r["step"], "loss": r["loss"], "step_time_s": r.get("step_time_s")})
                     for t, r in tail.rows],
            "steps": steps, "committed": checkpoints, "log_tail": (done.stdout + done.stderr)[-1500:], "cluster": cluster.name,
            "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
            "left": left}


def leftovers(name: str, run_dir: Path) -> dict[str, list]:
    """What of cluster ``name`` and of the run is still there after ``hosts.down``: its namespaces,
    links, and any process whose command line names the run's folder (a rank outside every host)."""
    from megatrain.launch import hosts

    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return {"netns": [ns for ns in hosts.list_netns() if ns.startswith(name)],
            "links": [link for link in hosts.list_links() if link.startswith(name)], "pids": pids}


def prepared_shards(work: Path) -> Path:
    """Shards of the tiny recipe in ``work`` (the hosts share this file system, not their /tmp)."""
    target = work / "shards"
    if target.exists():
        return target
    from megatrain.config import load_config
    from megatrain.data.shard import shard_corpus  # sharding is the ranks' input, made once here

    cfg = load_config(ROOT / CONFIG, ["data.max_source_bytes=300000", f"data.shard_url={target}"])
    shard_corpus(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    return target


def commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return f"{head}+dirty" if dirty else head


def work_dir(path: str | None) -> Path:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)
    return Path(tempfile.mkdtemp(prefix="cluster-faults-", dir="/var/tmp"))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
