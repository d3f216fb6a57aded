"""Hosts on this machine (megatrain/launch/hosts.py) for the launch tests: a cluster per module that
is always taken down, and the check that nothing of it is left."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatrain.launch import hosts


def machine_state() -> dict[str, set[str]]:
    """Namespaces, links and mounts of this machine's own namespaces: what a cluster must not leave."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {"netns": set(hosts.list_netns()),
            "links": {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()},
            "mounts": {" ".join(line.split()[3:5]) for line in Path("/proc/self/mountinfo").read_text().splitlines()}}


def leftovers(before: dict[str, set[str]], name: str) -> dict[str, set[str]]:
    """What exists now and did not before and is ``name``'s (another test's cluster may come and go)."""
    now = machine_state()
    return {kind: {item for item in now[kind] - before[kind] if name in item} for kind in now}


def assert_gone(before: dict[str, set[str]], name: str, pids: list[int]) -> None:
    assert leftovers(before, name) == {"netns": set(), "links": set(), "mounts": set()}
    assert name not in hosts.clusters()
    alive = [pid for pid in pids if hosts.alive(pid)]  # a zombie awaits its parent's wait(): dead
    assert alive == [], f"processes of cluster {name} still alive: {alive}"


def needs_hosts() -> None:
    """Hosts need root and ip: where either is missing the tests fail naming why; they never skip."""
    reason = hosts.available()
    if reason:
        pytest.fail(reason)


@pytest.fixture(scope="module")
def cluster2():
    """node0 and node1, owned by this test process; down at the end whatever happened."""
    needs_hosts()
    hosts.sweep()  # clusters of a test run killed with SIGKILL before this one
    before = machine_state()
    cluster = hosts.up(["node0", "node1"], owner_pid=os.getpid())
    seen: list[int] = []
    try:
        yield cluster
    finally:
        for role in cluster.hosts:
            seen += cluster.pids(role)
        hosts.down(cluster.name)
    assert_gone(before, cluster.name, seen)


@pytest.fixture(scope="module")
def served_cluster2():
    """node0, node1 and the head, redis and storage hosts with their services (megatrain cluster up)."""
    needs_hosts()
    from megatrain.launch import cluster_services

    hosts.sweep()
    before = machine_state()
    cluster, _ = cluster_services.up(2, services=True, owner_pid=os.getpid())
    seen: list[int] = []
    try:
        yield cluster
    finally:
        for role in cluster.hosts:
            seen += cluster.pids(role)
        hosts.down(cluster.name)
    assert_gone(before, cluster.name, seen)


