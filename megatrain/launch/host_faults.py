"""Host-level faults of ``reliability.faults`` on a cluster of ``megatrain/launch/hosts.py``.

- ``host_down``: every process of node ``fault.node``'s host SIGKILLed and its link removed (the
  machine is gone: nothing of it answers, nothing of it reports);
- ``partition``: its link down for ``duration_s``, then up again (the host lives on, cut off);
- ``slow_link``: its link limited to ``rate`` by tbf (until the stage ends);
- ``redis_host_down``: the redis host's processes SIGKILLed (all but its init, which holds the
  namespaces) and its link down for ``duration_s``; then the link comes up and Redis is restarted on
  the same address (``cluster_services.restart``: the same password, no persistence, as the cluster
  runs it: it comes back empty);
- ``storage_host_down``: the storage host's link down and its processes (moto's S3, the durable
  checkpoint store) frozen with SIGSTOP for ``duration_s``; then the link comes up and they go on
  (SIGCONT). Not SIGKILL: moto holds its objects in memory, and a restart would empty the store, where
  a real object store's disks outlive the outage (``cluster_services``'s docstring says why a frozen
  process is the honest stand-in: from outside it is a dead machine, and it comes back with its data).

``node`` plays no part in the service faults. What the ranks see is an outage of the store: retried,
temporary, nothing committed lost.

Injected by the node launcher (``megatrain.launch.nodes``, backend ``hosts``) once rank 0's metrics
reach ``fault.step``, as the cluster's operator would pull a cable; a marker
``<run_dir>/faults/<kind>-node-<i>.json`` keeps a ``once`` fault from firing in a later attempt.
Nothing tells the launcher that it happened: it finds out as a cluster does (heartbeats, the store).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from pydantic import TypeAdapter

from megatrain.config import FaultConfig
from megatrain.launch import hosts

SERVICE_HOSTS = {"redis_host_down": "redis", "storage_host_down": "storage"}
KINDS = ("host_down", "partition", "slow_link", *SERVICE_HOSTS)


def marker(run_dir: str | Path, kind: str, node: int) -> Path:
    if kind in SERVICE_HOSTS:
        return Path(run_dir) / "faults" / f"{kind}.json"
    return Path(run_dir) / "faults" / f"{kind}-node-{node}.json"


def listed_faults(configured: list) -> list:
    """The config's faults and those of ``MEGATRAIN_FAULTS`` (reliability/faults.py reads the same for the ranks)."""
    raw = os.environ.get("MEGATRAIN_FAULTS", "").strip()
    if not raw:
        return list(configured)
    data = json.loads(raw)
    return [*configured, *TypeAdapter(list[FaultConfig]).validate_python(data if isinstance(data, list) else [data])]


class HostFaults:
    """The host faults of one attempt; ``poll(step)`` fires those whose step has come."""

    def __init__(self, faults: list, cluster: hosts.Cluster, run_dir: str | Path, role_of) -> None:
        self.cluster, self.run_dir, self.role_of = cluster, Path(run_dir), role_of
        self.pending = [f for f in listed_faults(faults) if f.kind in KINDS
                        and not (f.once and marker(run_dir, f.kind, f.node).exists())]
        self.fired: list[dict] = []

    def poll(self, step: int) -> None:
        for fault in [f for f in self.pending if step >= f.step]:
            self.pending.remove(fault)
            role = SERVICE_HOSTS.get(fault.kind) or self.role_of(fault.node)
            host = self.cluster.host(role)
            record = {"kind": fault.kind, "node": fault.node, "host": role, "address": host.address,
                      "step": step, "time": time.time()}
            path = marker(self.run_dir, fault.kind, fault.node)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
            owner = "" if fault.kind in SERVICE_HOSTS else f" of node {fault.node}"
            print(f"[launch_nodes] injected fault {fault.kind}: host {role} ({host.address}){owner} "
                  f"at step {step}", flush=True)
            if fault.kind in SERVICE_HOSTS:
                from megatrain.launch import cluster_services

                self.cluster.set_link(role, up=False)  # first: a dead machine sends its peers no FIN
                if fault.kind == "storage_host_down":
                    record["frozen"] = cluster_services.freeze(self.cluster, role)
                    self._timer(fault.duration_s, self._thaw, role, record)
                else:
                    record["killed"] = kill_services(self.cluster, role)
                    self._timer(fault.duration_s, self._restart, role, record)
            elif fault.kind == "host_down":
                self.cluster.kill_host(role)
            elif fault.kind == "partition":
                self.cluster.set_link(role, up=False)
                self._timer(fault.duration_s, self._heal, role)
            else:
                self.cluster.slow_link(role, rate=fault.rate)
            self.fired.append(record)

    def _timer(self, delay_s: float, action, *args) -> None:
        # not a daemon: a launcher that ends first still heals the link and restarts the service at its time
        threading.Timer(delay_s, action, args=args).start()

    def _heal(self, role: str) -> None:
        try:
            self.cluster.set_link(role, up=True)
        except RuntimeError:  # the cluster went down first
            pass

    def _restart(self, role: str, record: dict) -> None:
        """Link up, the service started again; the time it answers again goes into the marker."""
        from megatrain.launch import cluster_services

        self._back(role, record, lambda: cluster_services.restart(self.cluster, role))

    def _thaw(self, role: str, record: dict) -> None:
        """Link up, the frozen service goes on with what it held; the time it answers goes into the marker."""
        from megatrain.launch import cluster_services

        self._back(role, record, lambda: cluster_services.thaw(self.cluster, role, record["frozen"]))

    def _back(self, role: str, record: dict, resume) -> None:
        try:
            self.cluster.set_link(role, up=True)
            resume()
        except (RuntimeError, OSError) as exc:  # the cluster went down first
            print(f"[launch_nodes] {role} not restarted: {exc}", flush=True)
            return
        record["restored"] = time.time()
        marker(self.run_dir, record["kind"], record["node"]).write_text(json.dumps(record))
        print(f"[launch_nodes] host {role} ({record['address']}) back: its service answers again", flush=True)


def kill_services(cluster: hosts.Cluster, role: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process of host ``role`` but its init; returns the pids killed."""
    init = cluster.host(role).init_pid
    pids = [pid for pid in cluster.pids(role) if pid != init]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s  # dead once a zombie; the init reaps its own, our children stay ours
    while any(hosts.alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids
