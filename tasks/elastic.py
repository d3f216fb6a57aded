"""A multi-node stage on this machine, and what happens when a node is lost: shrink and grow.

``launch_nodes`` is one attempt of a stage whose campaign has ``nnodes > 1`` and ``launcher:
local``: N torchrun agents of ``nproc_per_node`` ranks each (``megatrain.launch.nodes``).
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
    if campaign.self_check:
        from megatrain.reliability.selfcheck import run_node_checks

        failing += run_node_checks(cfg, node=f"node-{node}").failing
    return failing


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


@task(name="launch-nodes", retries=0, timeout_seconds=None)
def launch_nodes(campaign: CampaignConfig, index: int, config_path: str, attempt: int) -> dict:
    """One attempt of a multi-node stage on this machine (see the module docstring)."""
    from megatrain.launch.run_token import ensure_run_token
    from megatrain.launch.ranks import run_ranks
    from megatrain.launch.nodes import nodes_command
    from megatrain.observe.attempt_log import AttemptLog
    from megatrain.reliability.anomaly import clear_verdict, read_verdict
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
    command = nodes_command(config_path, plan.nodes, campaign.nproc_per_node, campaign.stage_dir(index) / "nodes",
                            [f"parallel.world_size={plan.world_size}"])
    watcher = HeartbeatWatcher.from_config(cfg.reliability, cfg.train.run_dir, cfg.run_id, world_size=plan.world_size)
    attempt_log = AttemptLog(cfg.train.run_dir, attempt, forward=logger.info)
    abandoned = abandoned_event(config_path)
    try:  # a hung rank on any node: stacks collected, every node stopped (megatrain.launch.ranks.run_ranks)
        result = run_ranks(command, on_line=attempt_log, watcher=watcher, timeout_s=campaign.stage_timeout_s, env=env,
                           verdict_reader=verdict, poll_s=min(1.0, cfg.reliability.heartbeat_interval_s),
                           should_stop=should_stop(abandoned))
    finally:
        watcher.close()
    result.message = f"{result.message} [{summary}]".strip()
    return attempt_state(result, attempt, attempt_log, abandoned, extra=dict(
        nodes=plan.nodes, excluded={str(n): c for n, c in plan.excluded.items()}, dp=plan.dp,
        accumulation=plan.accumulation, change=plan.change))
