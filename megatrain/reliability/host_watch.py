"""A lost host, found the way a cluster finds it: its ranks' heartbeats in the cluster's Redis stop.

    python -m megatrain.reliability.host_watch [the arguments of python -m megatrain.launch.nodes]

runs the node launcher (``megatrain.launch.nodes``, backend ``hosts``) with this watch: every poll it
reads the stage's heartbeats from the Redis of the redis host (``heartbeat_store.RedisSink``, signed
with the run token) and calls a node lost when every rank of it is silent for
``reliability.heartbeat_timeout_s`` (``init_timeout_s`` before its first beat). The exit of the
``nsenter`` process that started a host's launcher is no evidence: a killed host and a cut-off one
look alike from here, and a partitioned host's processes live on. The verdict names the host (role,
hostname its ranks reported, address on the bridge), the node, its ranks, their last step and how
long they have been silent; the launcher writes it to ``<run_dir>/faults/host-lost.json``.

Silence is measured against the beat's own timestamp: the hosts of one machine share its clock (a
real cluster's would need the store's time instead; see docs/architecture.md).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import sys
import time

from megatrain.reliability.heartbeat_store import make_sink


class HostWatch:
    """Called by the launcher's loop; returns a verdict dict for the first lost node, else None."""

    def __init__(self, cfg, cluster, nodes: list[int], nproc: int, role_of) -> None:
        self.cfg, self.cluster, self.nodes, self.nproc, self.role_of = cfg, cluster, nodes, nproc, role_of
        self.world_size = nproc * len(nodes)
        self.sink = make_sink(cfg.reliability, cfg.train.run_dir, cfg.run_id)
        self.started = time.time()
        self.patience_s = cfg.reliability.heartbeat_timeout_s + 5.0  # agents all ended: the beats decide by then
        self._last_read = 0.0

    def ranks(self, position: int) -> list[int]:
        return list(range(position * self.nproc, (position + 1) * self.nproc))

    def __call__(self) -> dict | None:
        now = time.time()
        if now - self._last_read < 0.5:
            return None
        self._last_read = now
        try:
            records = self.sink.read_all(self.world_size, started_after=self.started - 1.0)
        except Exception:  # noqa: BLE001 - Redis itself unreachable: the store's outage path, not a lost host
            return None
        rel = self.cfg.reliability
        silent = []
        for position, node in enumerate(self.nodes):
            ranks = self.ranks(position)
            beats = [records.get(r) for r in ranks]
            if any(b is None for b in beats):
                silent_s, limit = now - self.started, rel.init_timeout_s
            else:
                silent_s = now - max(b.timestamp for b in beats)
                limit = rel.heartbeat_timeout_s if all(b.first_step_done for b in beats) else rel.init_timeout_s
            if silent_s >= limit:
                silent.append((silent_s, position, node, beats))
        if not silent:
            return None
        # the node silent longest: its peers' ranks fall silent after it, failing on its absence
        silent_s, position, node, beats = max(silent, key=lambda item: item[0])
        ranks = self.ranks(position)
        role = self.role_of(node)
        host = self.cluster.host(role)
        hostname = next((b.host for b in beats if b is not None), role)
        steps = [b.step for b in beats if b is not None]
        return {"node": node, "host": role, "hostname": hostname, "address": host.address, "ranks": ranks,
                "last_step": max(steps) if steps else None, "silent_s": round(silent_s, 1),
                "evidence": "heartbeats in the cluster's Redis",
                "message": f"host {hostname} ({host.address}) lost: node {node}, ranks {ranks} silent for "
                           f"{silent_s:.1f} s (heartbeats; last step {max(steps) if steps else 'none'})"}


def main(argv: list[str] | None = None) -> int:
    from megatrain.launch import nodes

    def watch(cfg, cluster, stage_nodes, nproc):
        return HostWatch(cfg, cluster, stage_nodes, nproc, nodes.host_role)

    args = sys.argv[1:] if argv is None else argv
    if "--backend" not in args:
        args = ["--backend", "hosts", *args]
    return nodes.main(args, watch=watch)


if __name__ == "__main__":
    sys.exit(main())
