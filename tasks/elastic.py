"""A multi-node stage on this machine, and what happens when a node is lost: shrink and grow.

``launch_nodes`` is one attempt of a stage whose campaign has ``nnodes > 1`` and ``launcher:
local``: N torchrun agents of ``nproc_per_node`` ranks each (``megatrain.launch.nodes``); or of a
``launcher: hosts`` campaign: each node's ranks inside its host of the campaign's cluster
(``tasks/cluster.py``), watched by the host watch (``megatrain.reliability.host_watch``), whose
verdict on a lost host (its ranks' heartbeats silent in the cluster's Redis, never a process's
exit) ends the attempt; the host then fails its check for the rest of the stage. A hung rank on a
host is this task's watcher's (``hosts_watcher``, hung ranks only: ``host_watch.HungOnlyWatch``), its
verdict carrying the ranks' stacks, asked for through the cluster's Redis.
Before it starts the ranks it self-checks every node of the campaign (``check_node``) and
applies ``reliability.on_node_loss``:

- ``wait``: a failing node is re-checked for up to ``reliability.node_wait_s``; still failing, the
  stage fails naming the node and its failing checks;
- ``shrink``: after the same wait the attempt runs on the healthy nodes. The data-parallel size
  shrinks with the world size, gradient accumulation grows so the global batch stays the same,
  and the ranks restore the last committed checkpoint, resharded to the new layout. At a later
  attempt or stage the node is checked again and, once it passes, it rejoins (grow).

Every change of the node set is a Prefect event (``megatrain.elastic.shrink`` / ``grow``), a row
of the campaign's ``<id>-nodes`` table artifact, and part of the attempt's outcome (so the stage
result and the report show it).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.events import emit_event

from megatrain.config.campaign import CampaignConfig, stage_config
from megatrain.config import load_config
from megatrain.launch.shrink import change as layout_change, layout_for
from tasks._artifacts import create_table_artifact  # secrets hidden
from tasks._log import run_logger
from tasks.attempts import abandoned_event, attempt_state, should_stop


class NodeLost(RuntimeError):
    """No attempt can start: a node failed its self-check and the policy does not go on without it."""


@dataclass
class NodePlan:
    nodes: list[int]  # the campaign's node indices this attempt runs on
    excluded: dict[int, list[str]]  # node -> its failing checks
    world_size: int
    dp: int
    accumulation: int
    change: str | None  # "shrink" | "grow" | None, against the last attempt of the campaign


def check_node(campaign: CampaignConfig, index: int, node: int) -> list[str]:
    """The failing checks of one node (empty: healthy). A node killed by an injected
    ``evict_node`` fault fails until its stage ends; with ``self_check`` the measurements
    (GEMM, memory, storage, ...) run too, on this machine, under the node's name."""
    from megatrain.launch.nodes import evicted_marker

    cfg = stage_config(campaign, index)
    failing = []
    if evicted_marker(cfg.train.run_dir, node).exists():
        failing.append("alive (evicted by an injected evict_node fault)")
    if campaign.launcher == "hosts":
        failing += host_problems(campaign, cfg.train.run_dir, node)
    if campaign.self_check:
        from megatrain.reliability.selfcheck import run_node_checks

        failing += run_node_checks(cfg, node=f"node-{node}").failing
    return failing


def host_problems(campaign: CampaignConfig, run_dir: str, node: int) -> list[str]:
    """A node of a hosts campaign fails when the host watch called its host lost in this stage (its
    ranks' heartbeats fell silent: ``<run_dir>/host-attempts.jsonl``), for the rest of the stage as an
    evicted node does, and when its host does not answer an ICMP echo over the cluster's bridge (a
    host lost in an earlier stage, gone for good, is left out of the next stage's attempts)."""
    from megatrain.launch import hosts
    from megatrain.launch.nodes import host_role
    from megatrain.reliability.slow_link import echo_ms

    failing = []
    for row in _jsonl(Path(run_dir) / "host-attempts.jsonl"):
        lost = row.get("lost") or {}
        if lost.get("node") == node:
            failing.append(f"alive (host {lost.get('host')} named lost in attempt {row.get('attempt')}: its "
                           "ranks' heartbeats in the cluster's Redis fell silent)")
            break
    host = hosts.Cluster.load(campaign.cluster).host(host_role(node))
    if not any(echo_ms(host.address, payload=56) is not None for _ in range(3)):
        failing.append(f"reachable (host {host.role} at {host.address} answers no echo over the bridge)")
    return failing


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def lost_host(run_dir: str, since: float) -> dict | None:
    """The host watch's verdict of an attempt that started at ``since`` (``faults/host-lost.json``), or None."""
    try:
        verdict = json.loads((Path(run_dir) / "faults" / "host-lost.json").read_text())
    except (OSError, ValueError):
        return None
    return verdict if verdict.get("detected_at", 0.0) >= since else None


def plan_nodes(campaign: CampaignConfig, index: int, config_path: str) -> NodePlan:
    """Which nodes the next attempt runs on, after the self-checks and the policy."""
    cfg = stage_config(campaign, index)
    policy = cfg.reliability
    deadline = time.monotonic() + policy.node_wait_s
    while True:
        failing = {n: check_node(campaign, index, n) for n in range(campaign.nnodes)}
        excluded = {n: checks for n, checks in failing.items() if checks}
        if not excluded or time.monotonic() >= deadline:
            break
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    described = "; ".join(f"node {n}: {', '.join(c)}" for n, c in excluded.items())
    if excluded and policy.on_node_loss == "wait":
        raise NodeLost(f"{described} (reliability.on_node_loss=wait; waited {policy.node_wait_s:.0f} s)")
    nodes = [n for n in range(campaign.nnodes) if n not in excluded]
    if not nodes:
        raise NodeLost(f"every node failed its self-check: {described}")
    layout = layout_for(config_path, nodes, campaign.nproc_per_node)  # a split that cannot work is named here
    return NodePlan(nodes, excluded, layout.world_size, layout.dp, layout.accumulation,
                    layout_change(_last_nodes(campaign), nodes))


def _nodes_file(campaign: CampaignConfig) -> Path:
    return campaign.campaign_dir / "nodes.json"


def _last_nodes(campaign: CampaignConfig) -> list[int] | None:
    try:
        return json.loads(_nodes_file(campaign).read_text())[-1]["nodes"]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def record_plan(campaign: CampaignConfig, index: int, attempt: int, plan: NodePlan) -> list[dict]:
    """Append the plan to the campaign's node history; a change becomes an event and a table row."""
    path = _nodes_file(campaign)
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        rows = []
    row = {"stage": campaign.stages[index].name, "attempt": attempt, "nodes": plan.nodes,
           "excluded": {str(n): c for n, c in plan.excluded.items()}, "world_size": plan.world_size, "dp": plan.dp,
           "accumulation": plan.accumulation, "change": plan.change, "time": time.time()}
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2))
    if plan.change:
        emit_event(event=f"megatrain.elastic.{plan.change}",
                   resource={"prefect.resource.id": f"megatrain.config.campaign.{campaign.id}"},
                   payload={k: v for k, v in row.items() if k != "time"})
    create_table_artifact([{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items() if k != "time"}
                           for r in rows], key=f"{campaign.id}-nodes".lower().replace("_", "-").replace(".", "-"),
                          description="nodes of each attempt: shrink on node loss, grow when it passes again")
    return rows


def hosts_watcher(cluster_name: str, config_path: str, world_size: int):
    """The heartbeat watcher of a stage on a cluster's hosts: reading the beats in the cluster's Redis,
    as the ranks write them (the node launcher adds the same settings, ``nodes.hosts_overrides``),
    with its password (the flow's environment may hold another Redis's)."""
    from megatrain.launch import hosts
    from megatrain.launch.nodes import cluster_redis_password, hosts_overrides
    from megatrain.reliability.watcher import HeartbeatWatcher

    cfg = load_config(config_path, hosts_overrides(cluster_name))
    secret = cluster_redis_password(hosts.Cluster.load(cluster_name)) if cfg.reliability.redis_url else None
    return HeartbeatWatcher.from_config(cfg.reliability, cfg.train.run_dir, cfg.run_id, world_size, secret)


@task(name="launch-nodes", retries=0, timeout_seconds=None)
def launch_nodes(campaign: CampaignConfig, index: int, config_path: str, attempt: int) -> dict:
    """One attempt of a multi-node stage on this machine (see the module docstring)."""
    from megatrain.launch.run_token import ensure_run_token
    from megatrain.launch.ranks import run_ranks
    from megatrain.launch.nodes import nodes_command
    from megatrain.observe.attempt_log import AttemptLog
    from megatrain.reliability.anomaly import clear_verdict, read_verdict
    from megatrain.reliability.host_watch import HungOnlyWatch
    from megatrain.reliability.watcher import HeartbeatWatcher

    logger = run_logger()
    plan = plan_nodes(campaign, index, config_path)
    record_plan(campaign, index, attempt, plan)
    summary = (f"nodes {plan.nodes} of {campaign.nnodes}, {plan.world_size} ranks, dp {plan.dp}, accumulation "
               f"{plan.accumulation}" + (f" ({plan.change})" if plan.change else "")
               + "".join(f"; node {n} excluded: {', '.join(c)}" for n, c in plan.excluded.items()))
    (logger.warning if plan.change or plan.excluded else logger.info)("attempt %d: %s", attempt, summary)
    cfg = load_config(config_path)
    clear_verdict(cfg.train.run_dir)

    def verdict():
        found = read_verdict(cfg.train.run_dir)
        return asdict(found) if found is not None else None

    ensure_run_token()  # before the ranks' env and the watcher: only this run's ranks sign heartbeats it believes
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    on_hosts = campaign.launcher == "hosts"
    if on_hosts and not campaign.cluster:
        raise ValueError(f"campaign {campaign.id}: launcher hosts without a cluster (the flow brings one up: "
                         "tasks/cluster.py)")
    # on hosts the node launcher's host watch reads the ranks' beats in the cluster's Redis and names a lost
    # host; it ends the attempt, and the next one is planned here as for nodes on this machine
    command = nodes_command(config_path, plan.nodes, campaign.nproc_per_node, campaign.stage_dir(index) / "nodes",
                            [f"parallel.world_size={plan.world_size}"], cluster=campaign.cluster if on_hosts else None,
                            one_attempt=on_hosts)
    if on_hosts:  # hung ranks only: a silent one is the host watch's (a lost host); stacks through Redis
        watcher = HungOnlyWatch(hosts_watcher(campaign.cluster, config_path, plan.world_size),
                                fresh_s=max(2 * cfg.reliability.heartbeat_interval_s,
                                            cfg.reliability.heartbeat_timeout_s / 2))
    else:
        watcher = HeartbeatWatcher.from_config(cfg.reliability, cfg.train.run_dir, cfg.run_id,
                                               world_size=plan.world_size)
    attempt_log = AttemptLog(cfg.train.run_dir, attempt, forward=logger.info)
    abandoned = abandoned_event(config_path)
    started = time.time()
    try:  # a hung rank on any node: stacks collected, every node stopped (megatrain.launch.ranks.run_ranks)
        result = run_ranks(command, on_line=attempt_log, watcher=watcher, timeout_s=campaign.stage_timeout_s, env=env,
                           verdict_reader=verdict, poll_s=min(1.0, cfg.reliability.heartbeat_interval_s),
                           should_stop=should_stop(abandoned))
    finally:
        watcher.close()
    lost = lost_host(cfg.train.run_dir, started) if on_hosts else None
    if lost is not None and not result.ok:  # the cause is the host, not the survivors' ranks failing on its absence
        result.status, result.message, result.faulty_ranks = "crashed", lost["message"], lost["ranks"]
    result.message = f"{result.message} [{summary}]".strip()
    return attempt_state(result, attempt, attempt_log, abandoned, extra=dict(
        nodes=plan.nodes, excluded={str(n): c for n, c in plan.excluded.items()}, dp=plan.dp,
        accumulation=plan.accumulation, change=plan.change, lost_host=lost))
