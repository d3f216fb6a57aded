"""Host-level faults of ``reliability.faults`` on a cluster of ``megatrain/launch/hosts.py``.

- ``host_down``: every process of node ``fault.node``'s host SIGKILLed and its link removed (the
  machine is gone: nothing of it answers, nothing of it reports);
- ``partition``: its link down for ``duration_s``, then up again (the host lives on, cut off);
- ``slow_link``: its link limited to ``rate`` by tbf (until the stage ends).

Injected by the node launcher (``megatrain.launch.nodes``, backend ``hosts``) once rank 0's metrics
reach ``fault.step``, as the cluster's operator would pull a cable; a marker
``<run_dir>/faults/<kind>-node-<i>.json`` keeps a ``once`` fault from firing in a later attempt.
Nothing tells the launcher that it happened: it finds out as a cluster does (heartbeats, the store).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from pydantic import TypeAdapter

from megatrain.config import FaultConfig
from megatrain.launch import hosts

KINDS = ("host_down", "partition", "slow_link")


def marker(run_dir: str | Path, kind: str, node: int) -> Path:
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
            role = self.role_of(fault.node)
            host = self.cluster.host(role)
            record = {"kind": fault.kind, "node": fault.node, "host": role, "address": host.address,
                      "step": step, "time": time.time()}
            path = marker(self.run_dir, fault.kind, fault.node)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
            print(f"[launch_nodes] injected fault {fault.kind}: host {role} ({host.address}) of node {fault.node} "
                  f"at step {step}", flush=True)
            if fault.kind == "host_down":
                self.cluster.kill_host(role)
            elif fault.kind == "partition":
                self.cluster.set_link(role, up=False)
                threading.Timer(fault.duration_s, self._heal, args=(role,)).start()
            else:
                self.cluster.slow_link(role, rate=fault.rate)
            self.fired.append(record)

    def _heal(self, role: str) -> None:
        try:
            self.cluster.set_link(role, up=True)
        except RuntimeError:  # the cluster went down first
            pass
