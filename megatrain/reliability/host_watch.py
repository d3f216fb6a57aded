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

With ``reliability.on_node_loss: shrink`` a lost host does not end the stage: the next attempt
starts on the surviving nodes (``launch/shrink.py``, the rule the flow's self-check path uses too:
smaller DP, more accumulation, same global batch, the newest committed checkpoint resharded, its
data position re-split), with a new fencing epoch (``launch/fencing.py``) that keeps the lost
host's ranks, should they live on, from committing, uploading or beating. At most
``reliability.max_restarts`` such attempts; ``wait`` (the default) ends the stage with the verdict.
Each attempt is a row of ``<run_dir>/host-attempts.jsonl`` (nodes, layout, epoch, how it ended).
With ``--one-attempt`` (the pretrain flow's launch, ``tasks/elastic.py``) the launcher ends after the
first attempt with the verdict written, and the flow's elastic path plans the next attempt on the
survivors with the same rule.

Silence is measured against the beat's own timestamp: the hosts of one machine share its clock (a
real cluster's would need the store's time instead; see docs/architecture.md).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from megatrain.reliability.heartbeat_store import STEP_PHASES, make_sink
from megatrain.reliability.slow_link import SlowLinkView
from megatrain.reliability.watcher import WatchResult


class HungOnlyWatch:
    """The flow's watch of a stage on hosts (``launcher: hosts``): a fault only when every rank is
    beating and a step is frozen (hung), with the stacks of its verdict asked for through the store.
    Silence is the host watch's to judge (``HostWatch`` below: a lost host, named with its address and
    excluded from the next attempt): a rank on a lost host goes silent while its peers' steps freeze
    waiting for it, so a hung verdict counts only while every rank's last beat is at most ``fresh_s``
    old; and only for ranks stuck inside a step (compute, a collective): a save that waits out a
    store's outage (its own retries and commit timeout) or a slow start-up is no hang here. Otherwise
    the result is passed on without its faults (its notes kept)."""

    def __init__(self, watcher, fresh_s: float) -> None:  # a watcher.HeartbeatWatcher
        self.watcher, self.fresh_s = watcher, fresh_s

    def check(self) -> WatchResult:
        result = self.watcher.check()
        if result.ok:
            return result
        beating = len(result.records) == self.watcher.world_size and all(
            result.checked_at - record.timestamp <= self.fresh_s for record in result.records.values())
        in_steps = all(result.records[rank].phase in STEP_PHASES for rank in result.hung)
        if result.hung and beating and in_steps and not (result.dead or result.frozen or result.missing):
            return result
        return dataclasses.replace(result, dead=[], hung=[], frozen=[], waiting=[], missing=[])

    def __getattr__(self, name: str):  # collect_stacks, close, sink, since, world_size: the watcher's
        return getattr(self.watcher, name)


class HostWatch:
    """Called by the launcher's loop; returns a verdict dict for the first lost node, else None."""

    def __init__(self, cfg, cluster, nodes: list[int], nproc: int, role_of) -> None:
        self.cfg, self.cluster, self.nodes, self.nproc, self.role_of = cfg, cluster, nodes, nproc, role_of
        self.world_size = nproc * len(nodes)
        self.sink = make_sink(cfg.reliability, cfg.train.run_dir, cfg.run_id)
        self.started = time.time()
        self.patience_s = cfg.reliability.heartbeat_timeout_s + 5.0  # agents all ended: the beats decide by then
        self.timeout_s = cfg.reliability.heartbeat_timeout_s
        self.verdict: dict | None = None  # set by the launcher once it acts on one
        self._last_read = 0.0
        self.slow_link = SlowLinkView(cfg, cluster, nodes, nproc, role_of)  # a slow link named (and evicted)

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
            elif all(b.phase == "done" for b in beats):
                continue  # finished: its last beat said so; the silence after it is a rank exiting
            else:
                silent_s = now - max(b.timestamp for b in beats)
                limit = rel.heartbeat_timeout_s if all(b.first_step_done for b in beats) else rel.init_timeout_s
            if silent_s >= limit:
                silent.append((silent_s, position, node, beats))
        if not silent:
            return self.slow_link(records, now)
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
    from megatrain.config import load_config
    from megatrain.launch import nodes
    from megatrain.launch.shrink import layout_for

    watches: list[HostWatch] = []

    def watch(cfg, cluster, stage_nodes, nproc):
        watches.append(HostWatch(cfg, cluster, stage_nodes, nproc, nodes.host_role))
        return watches[-1]

    argv = sys.argv[1:] if argv is None else argv
    # the flow's elastic path (tasks/elastic.py) plans the next attempt itself: one attempt here
    one_attempt = "--one-attempt" in argv
    argv = [a for a in argv if a != "--one-attempt"]
    if "--backend" not in argv:
        argv = ["--backend", "hosts", *argv]
    args = nodes.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    current, extra = args.node_list, []
    for attempt in range(1, cfg.reliability.max_restarts + 2):
        code = nodes.run_nodes(args.config, current, args.nproc_per_node, args.nodes_dir, [*args.overrides, *extra],
                               args.backend, args.cluster, watch)
        verdict = watches[-1].verdict if watches else None
        _record(cfg.train.run_dir, attempt, current, extra, code, verdict)
        survivors = [n for n in current if verdict is not None and n != verdict["node"]]
        if code == 0 or verdict is None or cfg.reliability.on_node_loss != "shrink" or not survivors or one_attempt:
            return code
        if attempt == cfg.reliability.max_restarts + 1:
            print(f"[host_watch] reliability.max_restarts={cfg.reliability.max_restarts} spent; the stage ends",
                  flush=True)
            return code
        layout = layout_for(args.config, survivors, args.nproc_per_node, args.overrides)
        print(f"[host_watch] shrink: attempt {attempt + 1} on nodes {survivors} without node {verdict['node']} "
              f"({verdict['host']}): {layout.world_size} ranks, dp {layout.dp}, accumulation {layout.accumulation}, "
              f"from the newest committed checkpoint", flush=True)
        current, extra = survivors, layout.overrides()
    return code


def _record(run_dir: str, attempt: int, nodes: list[int], extra: list[str], code: int, verdict: dict | None) -> None:
    import json
    from pathlib import Path

    row = {"attempt": attempt, "nodes": nodes, "overrides": extra, "exit": code, "time": time.time(),
           "epoch": verdict.get("epoch") if verdict else None,
           "lost": {k: verdict.get(k) for k in ("node", "host", "fault", "fault_time", "detected_at", "detection_s")}
           if verdict else None}
    with open(Path(run_dir) / "host-attempts.jsonl", "a") as out:
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
