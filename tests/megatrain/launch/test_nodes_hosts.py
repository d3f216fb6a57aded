"""Node agents inside their hosts (megatrain.launch.nodes --backend hosts): two hosts x one rank of the
real trainer, started in each host as the Kubernetes Job starts a pod (megatrain.launch.pod), meeting
in the Redis of the redis host, gloo over the bridge, each node's staging on its host's own /tmp.
The losses are those of the loopback backend's two torchrun agents, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import redis

from megatrain.launch.nodes import cluster_endpoints, cluster_redis_password
from megatrain.launch.run_token import RUN_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4


def _launch(base: Path, shards: Path, name: str, backend: list[str]) -> list[tuple[int, float]]:
    run_dir = base / name
    overrides = ["model.n_layer=1", f"train.steps={STEPS}", "checkpoint.interval=2", "data.max_source_bytes=300000",
                 f"data.shard_url={shards}", "train.micro_batch_size=4", "train.log_interval=1",
                 "data.prefetch_batches=0", f"train.run_dir={run_dir}", f"checkpoint.durable_url={run_dir}/durable"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{RUN_TOKEN_ENV: f"token-{name}-0123456789ab"})
    done = subprocess.run([sys.executable, "-m", "megatrain.launch.nodes", "--config", "configs/tiny-cpu.yaml",
                           "--nodes-dir", str(run_dir / "nodes"), "--nodes", "0,1", "--nproc-per-node", "1", *backend,
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def test_two_hosts_train_as_the_loopback_nodes_do(served_cluster2, shared_dir, shard_url):
    shards = shared_dir / "shards"  # the cluster's shared volume: the session's shards live in this /tmp only
    shutil.copytree(shard_url, shards)
    loopback = _launch(shared_dir, shards, "loopback", [])
    in_hosts = _launch(shared_dir, shards, "hosts", ["--backend", "hosts", "--cluster", served_cluster2.name])
    assert len(loopback) == STEPS and in_hosts == loopback
    # staged on each host's private /tmp: nothing under the shared nodes dir, as on a node's local disk
    assert not (shared_dir / "hosts" / "nodes").exists() and (shared_dir / "loopback" / "nodes" / "node-1").exists()
    # each rank joined the rendezvous in the Redis host from its own host: hostname and a pid of that host
    url = cluster_endpoints(served_cluster2)["redis"]
    client = redis.Redis(host=url.split("//")[1].split(":")[0], port=6379, password=cluster_redis_password(served_cluster2))
    joined = {key.decode().rsplit("/", 1)[1]: client.get(key).decode().split(":")[:2]
              for key in client.scan_iter("megatrain:*join/rank*") if client.type(key) == b"string"}
    client.close()
    assert {rank: host for rank, (host, _) in joined.items()} == {"rank0": "node0", "rank1": "node1"}
    assert all(int(pid) < 100 for _, pid in joined.values())  # numbered in the host's PID namespace
