"""redis_host_down and storage_host_down (launch/host_faults.py) on a served cluster: the service host's
link is down for duration_s; Redis's processes die and it is back on the same address with the same
password, moto's (the S3 durable store) are frozen and go on with their objects. On two hosts x one
rank, a short run through a few seconds of either outage (a checkpoint upload and its fenced commit
fall into it) ends as a fault-free run does: same losses step for step, every checkpoint committed
(read back from S3: manifests and files), no host called lost."""

from __future__ import annotations

import socket
import threading
import time

from host_runs import ROOT, jsonl, launch, losses, manifests, overrides, redis_env, shards, step_url, use_s3

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


def _state(pid: int) -> str:
    """The process's state letter (R running, S sleeping, T stopped) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


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
    fired = {f["host"]: f for f in injector.fired}
    assert cluster.pids("redis") == [cluster.host("redis").init_pid]  # all but the init: Redis is gone
    assert sorted(fired["redis"]["killed"]) == sorted(p for p in before["redis"] if p != cluster.host("redis").init_pid)
    frozen = sorted(p for p in before["storage"] if p != cluster.host("storage").init_pid)
    assert frozen and sorted(fired["storage"]["frozen"]) == frozen
    assert cluster.pids("storage") == sorted(before["storage"])  # none killed
    assert all(_state(pid) == "T" for pid in frozen), [_state(pid) for pid in frozen]  # stopped, memory kept
    assert not _answers(cluster.host("redis").address, cluster_services.REDIS_PORT)
    assert not _answers(cluster.host("storage").address, cluster_services.S3_PORT)
    for kind in ("redis_host_down", "storage_host_down"):
        record = _wait_restored(marker(tmp_path, kind, 0))
        assert record["restored"] - record["time"] >= 1.0
    assert _answers(cluster.host("storage").address, cluster_services.S3_PORT)
    assert all(_state(pid) in "RS" for pid in frozen), [(pid, _state(pid)) for pid in frozen]  # going on
    env = redis_env(cluster)
    client = redis.Redis.from_url(env["url"], password=env["password"], socket_timeout=5)
    assert client.ping()  # the password the clients hold still opens it
    client.close()
    assert HostFaults(faults, cluster, tmp_path, host_role).pending == []  # once


def test_a_run_survives_the_redis_host_down_with_the_losses_of_a_clean_run(served_cluster2, shared_dir, shard_url,
                                                                            monkeypatch):
    use_s3(served_cluster2, monkeypatch)
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
    committed = sorted(manifests(faulted_dir))
    assert committed == sorted({*range(INTERVAL, STEPS + 1, INTERVAL), STEPS}), committed
    rows = jsonl(faulted_dir / "host-attempts.jsonl")
    assert [r["exit"] for r in rows] == [0], rows
    retried = [line for line in out.splitlines() if "retry" in line.lower() or "unreachable" in line.lower()]
    print(f"redis host down 4 s at step 3: run done in {wall:.1f} s (clean {clean_wall:.1f} s), losses equal to "
          f"the clean run's; {len(retried)} retried/unreachable lines, e.g. {retried[:2]}")


def _first_commit(run_dir, runner, timeout_s: float = 120.0) -> int:
    """The step of the run's first committed checkpoint (its manifest in S3), once there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and runner.is_alive():
        found = manifests(run_dir)
        if found:
            return min(found)
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of {run_dir} committed in {timeout_s:.0f} s (run alive: {runner.is_alive()})")


def test_a_run_rides_the_storage_host_down_and_loses_no_checkpoint(served_cluster2, shared_dir, shard_url, monkeypatch):
    """The outage comes once the first checkpoint is committed (the test fires it, by the same
    HostFaults the launcher uses, when that manifest is in S3: a fault at a step would race the upload,
    which runs ~1 s behind the steps here), so the store holds a commit from before it and the later
    uploads and commits fall into it."""
    from megatrain.checkpoint.restore import verify_checkpoint
    from megatrain.config import load_config
    from megatrain.launch.fencing import read_log

    use_s3(served_cluster2, monkeypatch)  # the checkpoints are read back as the ranks wrote them: from S3
    redis = redis_env(served_cluster2)
    monkeypatch.setenv("MEGATRAIN_REDIS_PASSWORD", redis["password"])  # the commit log, read as an operator would
    shards(shared_dir, shard_url)
    steps, interval = 20, 4
    clean_dir, faulted_dir = shared_dir / "clean", shared_dir / "faulted"
    code, out, clean_wall = launch(served_cluster2, clean_dir, "0,1", overrides(shared_dir, clean_dir, steps, interval))
    assert code == 0, out[-4000:]
    args = overrides(shared_dir, faulted_dir, steps, interval)
    run_id = load_config(ROOT / "configs/tiny-cpu.yaml", args).run_id
    done: dict = {}

    def run() -> None:
        try:
            done.update(zip(("code", "out", "wall"), launch(served_cluster2, faulted_dir, "0,1", args)))
        except Exception as exc:  # a commit that never comes (a store that lost a rank's marker) times out
            done.update(code=None, out=f"the run did not end: {exc!r}")

    runner = threading.Thread(target=run)
    runner.start()
    try:
        first = _first_commit(faulted_dir, runner)
        injector = HostFaults([FaultConfig(kind="storage_host_down", step=0, duration_s=4.0)], served_cluster2,
                              faulted_dir, host_role)
        injector.poll(first)
    finally:
        runner.join(timeout=300)
    assert done.get("code") == 0, done.get("out", "the run did not end in 300 s")[-4000:]
    out = done["out"]
    assert not (faulted_dir / "faults" / "host-lost.json").exists(), out[-3000:]
    record = _wait_restored(marker(faulted_dir, "storage_host_down", 0))
    clean, faulted = losses(clean_dir), losses(faulted_dir)
    assert sorted(faulted) == list(range(1, steps + 1)) and faulted == clean  # bit for bit: nothing redone, lost
    assert [r["exit"] for r in jsonl(faulted_dir / "host-attempts.jsonl")] == [0]

    expected = sorted({*range(interval, steps + 1, interval), steps})
    found = manifests(faulted_dir)
    assert sorted(found) == expected, sorted(found)  # a store restarted empty has lost the first commit here
    for step, manifest in found.items():  # every object of every commit is there and matches its manifest
        assert manifest["step"] == step and manifest["layout"]["world_size"] == 2
        assert verify_checkpoint(step_url(faulted_dir, step), manifest) == [], step
    commits = {c["step"]: c["time"] for c in read_log(redis["url"], run_id)["commits"]}
    assert sorted(commits) == expected, commits
    timeline = {s: round(t - record["time"], 2) for s, t in sorted(commits.items())}
    before = [s for s, t in commits.items() if t < record["time"]]
    after = [s for s, t in commits.items() if t > record["restored"]]
    # a commit before the outage (readable above), the next ones after it: they waited it out
    assert before == [first] and after and min(after) == first + interval, (timeline, record)
    stalled = [line for line in out.splitlines() if "retry" in line.lower() or "uploaded step" in line]
    print(f"storage host down {record['restored'] - record['time']:.1f} s after the commit of step {first}: "
          f"run done in {done['wall']:.1f} s (clean {clean_wall:.1f} s), losses equal; commits (s from the fault) "
          f"{timeline}; uploads/retries: {[line.split('INFO ')[-1][:90] for line in stalled]}")
