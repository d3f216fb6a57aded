"""At the end of a pytest run: no namespace, link, mount or process of a hosts cluster
(megatrain/launch/hosts.py, everything named ``mtc<6 hex>``) that this run made may be left.

A run's clusters are those owned by its own process or by one that is gone (an xdist worker, which
has ended by the time the controller gets here, or a test's child killed with SIGKILL), and those with
no state file. A cluster whose owner still runs (another test run on the machine) or that has no owner
(``megatrain cluster up``, an operator's) is not this run's. What is found fails the run (exit
status 1, each item listed) and is then taken down, so the next run starts clean.

Only the controlling process checks: an xdist worker ends before the others do, while their clusters
still stand (``workerinput`` is set on a worker's config only).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def session_clusters(own_pid: int) -> dict[str, dict[str, list]]:
    """cluster name -> what of it exists: namespaces, links, mounts, processes."""
    from megatrain.launch import hosts

    found: dict[str, dict[str, list]] = {}
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    for name in hosts.clusters():
        try:
            owner = hosts.Cluster.load(name).owner_pid
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            owner = -1  # no (readable) state file: nobody's, so left behind
        if owner is None or (owner not in (-1, own_pid) and hosts.alive(owner)):
            continue
        namespaces = [ns for ns in hosts.list_netns() if ns.startswith(f"{name}-")]
        found[name] = {"netns": namespaces, "links": [link for link in hosts.list_links() if link.startswith(name)],
                       "mounts": [line.split()[4] for line in mounts if name in line.split()[4]],
                       "pids": sorted(pid for ns in namespaces for pid in hosts.netns_pids(ns))}
    return found


def check(session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once every worker has ended
    from megatrain.launch import hosts

    if hosts.available() is not None:
        return  # no root: this run could make no cluster
    left = session_clusters(os.getpid())
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"cluster {name} left behind by this test session: " + "; ".join(
        f"{kind} {', '.join(map(str, items))}" for kind, items in what.items() if items) for name, what in left.items()]
    for name in left:
        hosts.down(name)
    if reporter is not None:
        reporter.ensure_newline()
    for line in lines:
        if reporter is not None:
            reporter.write_line(f"LEFTOVER {line}", red=True)
        else:
            print(f"LEFTOVER {line}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    check(session)
