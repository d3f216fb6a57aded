"""host_down through reliability.faults on two hosts x one rank (python -m megatrain.reliability.host_watch,
the node launcher with its heartbeat watch): at step 3 node1's host loses every process and its link;
the launcher learns it from the heartbeats in the redis host's Redis (not from an exit: it is told
nothing), names the host (hostname, address), the node and its ranks, and stops the other node.
A partition of node1 (its link down 6 s) is found the same way while it lasts; the link comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from host_runs import durable_url

from megatrain.launch.run_token import RUN_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[3]


def _run(cluster, shared_dir: Path, shard_url: str, fault: dict):
    import shutil

    shards = shared_dir / "shards"
    shutil.copytree(shard_url, shards)
    run_dir = shared_dir / "run"
    faults = json.dumps([fault])
    overrides = ["model.n_layer=1", "train.steps=200", "checkpoint.interval=100", "data.max_source_bytes=300000",
                 f"data.shard_url={shards}", "train.micro_batch_size=4", "train.log_interval=1",
                 "data.prefetch_batches=0", f"train.run_dir={run_dir}", f"checkpoint.durable_url={durable_url(run_dir)}",
                 "reliability.heartbeat_interval_s=0.5", "reliability.heartbeat_timeout_s=3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRAIN_FAULTS=faults,
               **{RUN_TOKEN_ENV: "token-host-down-0123456789ab"})
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatrain.reliability.host_watch", "--cluster", cluster.name,
                           "--config", "configs/tiny-cpu.yaml", "--nodes-dir", str(run_dir / "nodes"), "--nodes", "0,1",
                           "--nproc-per-node", "1", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    wall = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert f"injected fault {fault['kind']}" in out, out[-4000:]
    injected = json.loads((run_dir / "faults" / f"{fault['kind']}-node-1.json").read_text())
    assert (run_dir / "faults" / "host-lost.json").exists(), out[-3000:]
    verdict = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    print(f"verdict after {wall:.1f} s: {verdict['message']}")
    node1 = cluster.host("node1")
    assert (verdict["host"], verdict["hostname"], verdict["address"], verdict["ranks"], verdict["node"]) == \
        ("node1", "node1", node1.address, [1], 1)
    assert verdict["evidence"] == "heartbeats in the cluster's Redis"
    assert 3.0 <= verdict["silent_s"] < 10.0 and verdict["last_step"] >= injected["step"] - 1
    assert f"host node1 ({node1.address}) lost: node 1, ranks [1]" in out
    assert wall < 120, wall


def test_a_partition_is_a_lost_host_while_it_lasts_and_the_link_comes_back(served_cluster2, shared_dir, shard_url):
    _run(served_cluster2, shared_dir, shard_url, {"kind": "partition", "step": 3, "node": 1, "duration_s": 6})
    node1 = served_cluster2.host("node1")
    state = subprocess.run(["ip", "-o", "link", "show", node1.link], capture_output=True, text=True).stdout
    assert "state UP" in state or ",UP" in state, state  # healed after duration_s, the host still there
    assert served_cluster2.pids("node1")  # its init lives: a partition kills nothing


def test_host_down_is_found_by_heartbeats_and_named(served_cluster2, shared_dir, shard_url):
    _run(served_cluster2, shared_dir, shard_url, {"kind": "host_down", "step": 3, "node": 1})
    node1 = served_cluster2.host("node1")
    assert served_cluster2.pids("node1") == [] and node1.link not in os.listdir("/sys/class/net")
