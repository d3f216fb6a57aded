"""redis_host_down and storage_host_down (launch/host_faults.py) on a served cluster: the service host's
processes die and its link is down for duration_s, then the service is back on the same address (Redis
with the same password). On two hosts x one rank, a short run through a few seconds of the redis host
down (a checkpoint upload and its fenced commit fall into the outage) ends as a fault-free run does:
same losses step for step, every checkpoint committed, no host called lost."""

from __future__ import annotations

import socket
import time

from host_runs import jsonl, launch, losses, overrides, redis_env, shards

from megatrain.config import FaultConfig
from megatrain.launch import cluster_services
from megatrain.launch.host_faults import HostFaults, marker
from megatrain.launch.nodes import host_role

STEPS, INTERVAL = 10, 4


def _answers(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait_restored(path, timeout_s: float = 30.0) -> dict:
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = json.loads(path.read_text())
        if "restored" in record:
            return record
        time.sleep(0.1)
    raise AssertionError(f"{path}: the service was not restarted in {timeout_s:.0f} s")


def test_service_hosts_go_down_and_come_back_on_their_address(served_cluster2, tmp_path):
    import redis

    cluster = served_cluster2
    faults = [FaultConfig(kind="redis_host_down", step=1, duration_s=1.0),
              FaultConfig(kind="storage_host_down", step=1, duration_s=1.0)]
    before = {role: cluster.pids(role) for role in ("redis", "storage")}
    injector = HostFaults(faults, cluster, tmp_path, host_role)
    injector.poll(1)
    for role in ("redis", "storage"):
        assert cluster.pids(role) == [cluster.host(role).init_pid]  # all but the init: the service is gone
        assert sorted(injector.fired[[f["host"] for f in injector.fired].index(role)]["killed"]) == \
            sorted(p for p in before[role] if p != cluster.host(role).init_pid)
    assert not _answers(cluster.host("redis").address, cluster_services.REDIS_PORT)
    for kind in ("redis_host_down", "storage_host_down"):
        record = _wait_restored(marker(tmp_path, kind, 0))
        assert record["restored"] - record["time"] >= 1.0
    assert _answers(cluster.host("storage").address, cluster_services.S3_PORT)
    env = redis_env(cluster)
    client = redis.Redis.from_url(env["url"], password=env["password"], socket_timeout=5)
    assert client.ping()  # the password the clients hold still opens it
    client.close()
    assert HostFaults(faults, cluster, tmp_path, host_role).pending == []  # once


def test_a_run_survives_the_redis_host_down_with_the_losses_of_a_clean_run(served_cluster2, shared_dir, shard_url):
    shards(shared_dir, shard_url)
    clean_dir, faulted_dir = shared_dir / "clean", shared_dir / "faulted"
    code, out, clean_wall = launch(served_cluster2, clean_dir, "0,1", overrides(shared_dir, clean_dir, STEPS, INTERVAL))
    assert code == 0, out[-4000:]
    # at step 3 of 10, 4 s: the upload and fenced commit of step 4 (and heartbeats, the watch's reads) hit it
    fault = {"kind": "redis_host_down", "step": 3, "duration_s": 4.0}
    code, out, wall = launch(served_cluster2, faulted_dir, "0,1", overrides(shared_dir, faulted_dir, STEPS, INTERVAL),
                             [fault])
    assert code == 0, out[-4000:]
    assert "injected fault redis_host_down: host redis" in out and "host redis" in out and "back" in out, out[-3000:]
    assert not (faulted_dir / "faults" / "host-lost.json").exists(), out[-3000:]
    record = marker(faulted_dir, "redis_host_down", 0)
    assert record.exists()
    clean, faulted = losses(clean_dir), losses(faulted_dir)
    assert sorted(faulted) == list(range(1, STEPS + 1)) and faulted == clean  # bit for bit: nothing redone, lost
    committed = sorted(p.name for p in (faulted_dir / "durable").glob("step-*") if (p / "manifest.json").exists())
    assert committed == [f"step-{s:08d}" for s in sorted({*range(INTERVAL, STEPS + 1, INTERVAL), STEPS})], committed
    rows = jsonl(faulted_dir / "host-attempts.jsonl")
    assert [r["exit"] for r in rows] == [0], rows
    retried = [line for line in out.splitlines() if "retry" in line.lower() or "unreachable" in line.lower()]
    print(f"redis host down 4 s at step 3: run done in {wall:.1f} s (clean {clean_wall:.1f} s), losses equal to "
          f"the clean run's; {len(retried)} retried/unreachable lines, e.g. {retried[:2]}")
