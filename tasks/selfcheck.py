"""Run the node self-check (GEMM, memory bandwidth, all-reduce, storage, Redis; the card judged
against its kind's expected figures)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import task

from megatrain.config.campaign import CampaignConfig, stage_config
from megatrain.errors import one_line
from tasks._artifacts import create_table_artifact  # secrets hidden
from tasks._log import run_logger


class SelfCheckFailed(RuntimeError):
    pass


@task(name="self-check", retries=1, retry_delay_seconds=5, timeout_seconds=600)
def run_self_check(campaign: CampaignConfig) -> dict:
    """Fails (naming the node and the check) when a measurement misses its threshold, or, with
    ``reliability.selfcheck.strict``, when the card is slow against its kind (naming the card, the
    metric, measured vs expected): the campaign stops before training. On a cluster the failing
    nodes are the eviction list the launcher honours."""
    return _check_node(stage_config(campaign, 0), campaign.campaign_dir / "selfcheck.json", campaign.id)


@task(name="self-check-stage", retries=1, retry_delay_seconds=5, timeout_seconds=None)
def check_stage_nodes(config_path: str, campaign_id: str, nodes: str = "", wait_idle_s: float = 900.0) -> dict:
    """The self-check an anomaly event asks for: the stage's own run config (its storage, Redis
    and thresholds), results beside it. ``nodes`` are the hosts that raised the event. The stage
    relaunches right after a rollback: the check waits (up to ``wait_idle_s``) for its ranks to
    stop, so that it measures the nodes rather than their competition with training."""
    from megatrain.config import load_config

    cfg = load_config(config_path)
    logger = run_logger()
    logger.info("self-check for campaign %s (stage config %s), raised by node(s) %s", campaign_id, config_path, nodes or "?")
    deadline = time.monotonic() + wait_idle_s
    while _live_ranks(cfg) and time.monotonic() < deadline:
        time.sleep(5.0)
    if _live_ranks(cfg):
        logger.warning("the stage still trains after %.0f s: measuring beside it (throughput checks read low)", wait_idle_s)
    return _check_node(cfg, Path(config_path).parent / "selfcheck.json", campaign_id)


def _live_ranks(cfg) -> list[int]:
    """Ranks of the stage with a fresh heartbeat that is not "done" (file heartbeats; none seen
    with Redis heartbeats, which then count as idle)."""
    live = []
    for path in (Path(cfg.train.run_dir) / "heartbeats").glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if beat.get("phase") != "done" and time.time() - beat.get("timestamp", 0) < cfg.reliability.heartbeat_timeout_s:
            live.append(beat.get("rank"))
    return live


def _check_node(cfg, out: Path, campaign_id: str) -> dict:
    """Measures this node, records it (JSON beside the campaign, a table artifact: measured, the
    fixed limit, the card's expected figure, measured / expected, the verdict) and fails on a
    failed check; a slow card outside ``strict`` is a warning line and training goes on."""
    from megatrain.reliability.selfcheck import run_node_checks

    report = run_node_checks(cfg)
    rows = [
        {"node": report.node, "card": report.card or report.device, "check": c.name,
         "value": None if c.value is None else round(c.value, 3), "threshold": c.threshold,
         "expected": c.expected, "fraction": None if c.fraction is None else round(c.fraction, 3),
         "verdict": c.verdict, "unit": c.unit, "passed": c.passed, "detail": c.detail}
        for c in report.checks
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    create_table_artifact(rows, key=f"{campaign_id}-selfcheck".lower().replace("_", "-").replace(".", "-"),
                          description=f"node self-check ({report.device}" + (f", judged as {report.card})" if report.card else ")"))
    logger = run_logger()
    for row in rows:
        logger.info("%(node)s %(check)s: %(value)s %(unit)s (threshold %(threshold)s, expected %(expected)s, "
                    "verdict %(verdict)s) passed=%(passed)s", row)
    for warning in report.warnings:
        logger.warning("self-check %s: %s", report.node, warning)
    failed = [r for r in rows if not r["passed"]]
    if failed:
        raise SelfCheckFailed("self-check failed: " + "; ".join(
            f"{r['node']}: {r['check']}" + (f" ({one_line(r['detail'])[:300]})" if r["detail"] else "") for r in failed))
    return {"node": report.node, "card": report.card, "checks": len(rows), "warnings": report.warnings, "path": str(out)}
