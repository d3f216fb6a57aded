"""Hosts as namespaces (megatrain/launch/hosts.py): each its own address, hostname, pids, /dev/shm and
/tmp; they reach each other over the bridge (a gloo all-reduce across two hosts); ``down`` and
``sweep`` leave no namespace, link, mount or process, also after the owning run was SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_gone, machine_state, needs_hosts

from megatrain.launch import hosts
from megatrain.launch.nodes import cluster_s3_env

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("hosts_worker.py")


def _in(cluster, role, script: str) -> str:
    result = subprocess.run(cluster.command(role, ["sh", "-c", script], cwd=ROOT), env=cluster.env(role),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_each_host_has_its_own_address_name_pids_shm_and_tmp(cluster2, tmp_path):
    mine = f"mine-{cluster2.name}"  # a name no other process of the machine uses
    seen = {}
    for role in ("node0", "node1"):
        seen[role] = _in(cluster2, role, f"hostname; ip -4 -o addr show eth0 | awk '{{print $4}}'; echo $$; "
                                         f"echo {role} > /dev/shm/{mine}; echo {role} > /tmp/{mine}; ls /dev/shm /tmp")
    for role, out in seen.items():
        name, address, pid, *listing = out.splitlines()
        assert name == role
        assert address == f"{cluster2.host(role).address}/24"
        assert int(pid) < 100  # numbered in the host's own PID namespace (its init is 1)
        assert [line for line in listing if line == mine] == [mine, mine]  # one in /dev/shm, one in /tmp
    assert cluster2.host("node0").address != cluster2.host("node1").address
    for role, other in (("node0", "node1"), ("node1", "node0")):
        assert _in(cluster2, role, f"cat /dev/shm/{mine} /tmp/{mine}") == f"{role}\n{role}"  # its own, not the other's
    assert not Path(f"/dev/shm/{mine}").exists() and not Path(f"/tmp/{mine}").exists()  # the machine's own stay apart
    # the shared file system is shared (a cluster's volume); another host's processes are not seen
    assert _in(cluster2, "node1", f"cat {ROOT / 'pyproject.toml'} | head -1") == (ROOT / "pyproject.toml").read_text().splitlines()[0]
    assert _in(cluster2, "node1", "ls /proc | grep -c '^[0-9]'") < "9"
    assert _in(cluster2, "node0", "getent hosts node1 | awk '{print $1}'") == cluster2.host("node1").address


def test_gloo_all_reduce_across_two_hosts(cluster2):
    master = cluster2.host("node0").address
    procs = []
    for rank, role in enumerate(("node0", "node1")):
        env = cluster2.env(role, {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": master,
                                  "MASTER_PORT": "29611"})
        procs.append(subprocess.Popen(cluster2.command(role, [sys.executable, str(WORKER)], cwd=ROOT), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    # single-process reference: 1 + 2 summed over the two ranks
    assert [(r["rank"], r["hostname"], r["sum"]) for r in rows] == [(0, "node0", 3.0), (1, "node1", 3.0)]


def test_links_go_down_and_up_and_a_killed_host_loses_its_link(cluster2):
    probe = f"{sys.executable} -c \"import socket; socket.create_connection(('{cluster2.gateway}', 1), timeout=1)\" " \
            "2>&1 | tail -1"
    # the gateway has nothing on port 1: refused means reached, timed out means cut off
    assert "refused" in _in(cluster2, "node1", probe)
    cluster2.set_link("node1", up=False)
    try:
        assert "timed out" in _in(cluster2, "node1", probe)
    finally:
        cluster2.set_link("node1", up=True)
    deadline = time.monotonic() + 10
    while "refused" not in _in(cluster2, "node1", probe):
        assert time.monotonic() < deadline, "node1's link did not come back"
    cluster2.slow_link("node1", rate="1mbit")
    assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", cluster2.host("node1").link],
                                   capture_output=True, text=True).stdout
    cluster2.clear_link("node1")


def _snapshot_pids(name: str) -> list[int]:
    return [pid for ns in hosts.list_netns() if ns.startswith(name) for pid in hosts.netns_pids(ns)]


def test_a_sigkilled_owner_leaves_nothing_that_sweep_does_not_remove():
    needs_hosts()
    before = machine_state()
    owner = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         "from megatrain.launch import hosts\n"
         "c = hosts.up(['node0', 'node1'], owner_pid=os.getpid())\n"
         "subprocess.Popen(c.command('node1', ['sleep', '600']), start_new_session=True)\n"
         "print(c.name, flush=True)\n"
         "time.sleep(600)\n"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    name = ""
    try:
        name = owner.stdout.readline().strip()
        assert name.startswith(hosts.PREFIX), name
        deadline = time.monotonic() + 10
        while not any(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sleep") for p in _snapshot_pids(name)):
            assert time.monotonic() < deadline, "the host's sleep did not start"
            time.sleep(0.05)
        pids = _snapshot_pids(name)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert name in hosts.clusters()  # the host outlives its killed owner, as a machine would
        assert name in hosts.sweep()
        assert_gone(before, name, pids)
    finally:
        owner.kill()
        owner.wait()
        if name.startswith(hosts.PREFIX):
            hosts.down(name)


def test_cluster_up_and_down_from_the_command_line():
    needs_hosts()
    before = machine_state()
    megatrain = [sys.executable, "-m", "megatrain.cli", "cluster"]
    up = subprocess.run([*megatrain, "up", "--hosts", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    name = up.stdout.split()[1] if up.stdout.startswith("cluster ") else ""
    try:
        assert up.returncode == 0, up.stderr
        cluster = hosts.Cluster.load(name)
        assert list(cluster.hosts) == ["node0", "head", "redis", "storage"]
        pids = [pid for role in cluster.hosts for pid in cluster.pids(role)]
        ping = (f"{sys.executable} -c \"import redis; print(redis.Redis(host='redis', port=6379, "
                f"password=open('{hosts.STATE_DIR / (name + '.redis')}').read()).ping())\"")
        assert _in(cluster, "node0", ping) == "True"  # the Redis host, by name, over the bridge
        assert f"s3       http://{cluster.host('storage').address}:5000" in up.stdout
        assert "bucket   s3://megatrain" in up.stdout
        s3 = " ".join(f"{k}={v}" for k, v in cluster_s3_env(cluster).items())
        write = (f"{s3} {sys.executable} -c \"from megatrain import storage; "
                 "storage.write_bytes('s3://megatrain/t/a', b'x'); print(storage.read_bytes('s3://megatrain/t/a'))\"")
        assert _in(cluster, "node0", write) == "b'x'"  # the bucket up made, from a node host over the bridge
        down = subprocess.run([*megatrain, "down", name], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert "4 namespaces" in down.stdout
        assert_gone(before, name, pids)
    finally:
        if name:
            hosts.down(name)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="cluster name"):
        hosts.down("not-a-cluster")
    needs_hosts()
    with pytest.raises(ValueError, match="host role 'Node 0'"):
        hosts.up(["Node 0"])


def test_host_faults_fire_on_their_step(cluster2, tmp_path):
    from megatrain.config import FaultConfig
    from megatrain.launch.host_faults import HostFaults, marker
    from megatrain.launch.nodes import host_role

    faults = [FaultConfig(kind="slow_link", step=2, node=1, rate="2mbit"),
              FaultConfig(kind="partition", step=2, node=0, duration_s=1.0), FaultConfig(kind="kill_rank", step=1)]
    injector = HostFaults(faults, cluster2, tmp_path, host_role)
    injector.poll(1)
    assert injector.fired == [] and len(injector.pending) == 2  # kill_rank is the ranks' own fault
    injector.poll(2)
    assert [(f["kind"], f["host"], f["address"]) for f in injector.fired] == [
        ("slow_link", "node1", cluster2.host("node1").address), ("partition", "node0", cluster2.host("node0").address)]
    assert marker(tmp_path, "partition", 0).exists() and marker(tmp_path, "slow_link", 1).exists()
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", cluster2.host("node1").link], capture_output=True, text=True)
    assert "tbf" in qdisc.stdout and "2Mbit" in qdisc.stdout, qdisc.stdout
    link = ["ip", "-o", "link", "show", cluster2.host("node0").link]
    assert "state DOWN" in subprocess.run(link, capture_output=True, text=True).stdout
    deadline = time.monotonic() + 10
    while "state DOWN" in subprocess.run(link, capture_output=True, text=True).stdout:  # healed after duration_s
        assert time.monotonic() < deadline, "node0's link stayed down"
        time.sleep(0.1)
    cluster2.clear_link("node1")
    assert HostFaults(faults, cluster2, tmp_path, host_role).pending == []  # once: a later attempt fires nothing
