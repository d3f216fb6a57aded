"""The case of test_host_fencing.py and test_host_split_brain.py: fencing a partitioned host's stale
ranks with the attempt epoch (launch/fencing.py), on two hosts x one rank with
reliability.on_node_loss: shrink.

- node1 (not rank 0's host) partitioned at step 5 for 7 s: the watch names it lost like host_down, the
  attempt ends (node1's ranks are not signalled: out of reach, they live on), attempt 2 with epoch + 1
  runs on node0; once the link is back the stale rank's heartbeats are refused by the store, and a stale
  writer in node1 (the real upload and heartbeat paths, old epoch) is refused its heartbeat and commit.
- node0 (rank 0's host, the committer) partitioned: node1 goes on alone as rank 0; exactly one attempt
  commits any given step.

Both: every commit in the run's commit log and every manifest carries its epoch, and no commit of the
old epoch happened after the new epoch was issued (the fence). The detection time is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from host_runs import ROOT, durable_url, jsonl, launch, manifests, overrides, redis_env, shards, use_s3

from megatrain.config import load_config
from megatrain.launch.fencing import EPOCH_ENV, read_log

STEPS, INTERVAL, PARTITION_S = 20, 2, 7
WRITER = Path(__file__).with_name("stale_writer.py")


def _stale_writer(cluster, role: str, run_id: str, epoch: int, run_dir: Path, url: str, password: str) -> dict:
    """The old epoch's writer in the healed host: a heartbeat, then an upload with commit of a staged step."""
    from megatrain import storage

    staged = run_dir / "stale-staging" / "step-00000099"
    first = f"{durable_url(run_dir)}/step-{min(manifests(run_dir)):08d}"
    staged.mkdir(parents=True)
    for obj in storage.find(first):  # the committed step's objects, fetched from S3 into local staging
        if not obj.endswith("/manifest.json"):
            (staged / obj[len(first) + 1:]).parent.mkdir(parents=True, exist_ok=True)
            (staged / obj[len(first) + 1:]).write_bytes(storage.read_bytes(obj))
    for marker in staged.glob("rank-*.done.json"):  # a marker as the stale rank staged it: its own epoch
        data = json.loads(marker.read_text())
        marker.write_text(json.dumps({**data, "epoch": epoch}))
    env = cluster.env(role, dict(os.environ, **{EPOCH_ENV: str(epoch), "MEGATRAIN_REDIS_PASSWORD": password}))
    done = subprocess.run(cluster.command(role, [sys.executable, str(WRITER), url, run_id, str(staged),
                                                 durable_url(run_dir)], cwd=ROOT), env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_commits(run_dir: Path, log: dict, epochs: list[dict]) -> dict[int, set[int]]:
    old, new = epochs[0]["epoch"], epochs[1]["epoch"]
    fence = log["issued"][new]["time"]
    by_step: dict[int, set[int]] = defaultdict(set)
    for record in log["commits"]:
        by_step[record["step"]].add(record["epoch"])
        assert record["epoch"] in (old, new), record
        assert not (record["epoch"] == old and record["time"] > fence), f"old epoch committed after the fence: {record}"
    assert all(len(e) == 1 for e in by_step.values()), dict(by_step)  # exactly one attempt per step
    committed = manifests(run_dir)  # from the storage host's S3
    assert {s: {m["epoch"]} for s, m in committed.items()} == dict(by_step)  # the files agree with the log
    assert max(committed) == STEPS and 99 not in committed
    return by_step


def fenced_run(served_cluster2, shared_dir, shard_url, lost: int, monkeypatch) -> dict:
    use_s3(served_cluster2, monkeypatch)  # the checkpoints live on the storage host's S3; the stale writer's too
    shards(shared_dir, shard_url)
    run_dir = shared_dir / f"fence-{lost}"
    args = [*overrides(shared_dir, run_dir, STEPS, INTERVAL), "reliability.on_node_loss=shrink"]
    fault = {"kind": "partition", "step": 5, "node": lost, "duration_s": PARTITION_S}
    code, out, wall = launch(served_cluster2, run_dir, "0,1", args, [fault])
    assert code == 0, out[-6000:]
    verdict = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    print("\n".join(line for line in out.splitlines() if line.startswith(("[launch_nodes]", "[host_watch]"))
                     or "restored step" in line or "lease" in line))
    print(f"partition of node{lost} detection: {verdict['detection_s']:.2f} s after the fault (heartbeat timeout "
          f"{verdict['heartbeat_timeout_s']} s); whole run {wall:.1f} s")
    assert (verdict["node"], verdict["fault"]) == (lost, "partition")
    # the fault is stamped just after the link goes down, the silence counted from the last beat before it
    assert verdict["heartbeat_timeout_s"] - 0.5 <= verdict["detection_s"] < verdict["heartbeat_timeout_s"] + 4
    epochs = jsonl(run_dir / "epochs.jsonl")
    survivor = 1 - lost
    assert [e["nodes"] for e in epochs] == [[0, 1], [survivor]] and epochs[1]["epoch"] == epochs[0]["epoch"] + 1

    cfg = load_config(ROOT / "configs/tiny-cpu.yaml", args)
    redis = redis_env(served_cluster2)
    monkeypatch.setenv("MEGATRAIN_REDIS_PASSWORD", redis["password"])  # to read the store as an operator would
    deadline = time.monotonic() + 10  # the healed host's stale rank beats every 0.5 s: the store refuses them
    while time.monotonic() < deadline and not read_log(redis["url"], cfg.run_id)["fenced"].get("heartbeat"):
        time.sleep(0.5)
    answers = _stale_writer(served_cluster2, f"node{lost}", cfg.run_id, epochs[0]["epoch"], run_dir,
                            redis["url"], redis["password"])
    log = read_log(redis["url"], cfg.run_id)
    print(f"refused writes of epoch {epochs[0]['epoch']} after the fence: {log['fenced']}; stale writer: {answers}")
    assert answers["heartbeat"].startswith("refused") and answers["commit"].startswith("refused"), answers
    assert log["fenced"].get("heartbeat", 0) >= 2 and log["fenced"].get("upload", 0) >= 1, log["fenced"]
    # The cut-off host was refused; anything refused elsewhere is of the old epoch too (the survivor's
    # rank of the first attempt may still beat between the new epoch's issue and its own exit).
    assert f"node{lost}" in {r["host"] for r in log["refused"]}, log["refused"]
    assert {r["epoch"] for r in log["refused"]} == {epochs[0]["epoch"]}, log["refused"]
    by_step = _check_commits(run_dir, log, epochs)
    assert epochs[1]["epoch"] in {e for s in by_step.values() for e in s}  # the new attempt committed
    return log
