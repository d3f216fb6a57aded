"""The session's end fails a test run that leaves a hosts cluster behind (tests/leftover_clusters.py),
also when an xdist worker made it, and checks once, in the controller; a run that takes its cluster
down ends as it would without the check. Runs a small inner pytest session in a temp folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.launch import hosts

ROOT = Path(__file__).resolve().parents[1]

LEAKS = """
import os
from megatrain.launch import hosts

def test_leaves_a_cluster():
    cluster = hosts.up(["node0"], owner_pid=os.getpid())
    print("CLUSTER", cluster.name)
"""
CLEAN = """
import os
from megatrain.launch import hosts

def test_takes_its_cluster_down():
    cluster = hosts.up(["node0"], owner_pid=os.getpid())
    print("CLUSTER", cluster.name)
    hosts.down(cluster.name)
"""


def _session(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "leftover_clusters",
                           "-s", "--rootdir", str(tmp_path), *args, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    MADE.extend(line.split("CLUSTER ", 1)[1].split()[0] for line in (done.stdout + done.stderr).splitlines()
                if "CLUSTER " in line and "LEFTOVER" not in line)
    return done


MADE: list[str] = []  # clusters the inner sessions printed: taken down here should the check not have


@pytest.fixture
def root_hosts():
    reason = hosts.available()
    if reason:
        pytest.skip(reason)
    yield
    for name in MADE:  # only these: other tests' clusters (xdist's other worker) come and go meanwhile
        if name in hosts.clusters():
            hosts.down(name)


def test_a_cluster_left_by_a_worker_fails_the_session_once(root_hosts, tmp_path):
    done = _session(tmp_path, {"test_a.py": LEAKS, "test_b.py": CLEAN}, "-n", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "2 passed" in out, out[-3000:]  # the tests passed: the session fails on what they left
    leftover = [line[line.index("LEFTOVER cluster "):] for line in out.splitlines() if "LEFTOVER cluster " in line]
    assert len(leftover) == 1, out[-3000:]  # the controller only, once
    name = leftover[0].split()[2]
    assert "netns" in leftover[0] and f"{name}-node0" in leftover[0] and "pids" in leftover[0], leftover[0]
    assert name not in hosts.clusters() and not any(ns.startswith(name) for ns in hosts.list_netns())


def test_a_session_that_leaves_nothing_passes(root_hosts, tmp_path):
    done = _session(tmp_path, {"test_b.py": CLEAN})
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "LEFTOVER" not in out, out[-3000:]


def test_without_xdist_the_session_itself_is_the_owner(root_hosts, tmp_path):
    done = _session(tmp_path, {"test_a.py": LEAKS})
    out = done.stdout + done.stderr
    assert done.returncode == 1 and out.count("LEFTOVER cluster ") == 1, out[-3000:]
