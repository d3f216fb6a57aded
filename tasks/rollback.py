"""Roll a stage back after an anomaly: pick the checkpoint, record the data window to skip, and
tell the world (a Prefect event per rollback, which an automation can act on)."""

from __future__ import annotations

import socket
from pathlib import Path

from prefect import task
from prefect.events import emit_event

from megatrain.config import load_config
from megatrain.reliability.rollback import RollbackRecord, append_rollback, read_rollbacks
from tasks._artifacts import create_markdown_artifact  # secrets hidden
from tasks._log import run_logger


class RollbackLimitExceeded(RuntimeError):
    pass


def _history_text(records: list[RollbackRecord]) -> str:
    return "; ".join(f"{r.kind} at step {r.anomaly_step} -> step {r.restore_step}, skipped {r.skip_samples}"
                     for r in records)


@task(name="rollback", retries=2, retry_delay_seconds=2, timeout_seconds=120)
def rollback(campaign_id: str, stage: str, config_path: str, verdict: dict, count: int) -> dict:
    """Append a rollback record that the relaunched ranks apply after restoring.

    Restores to the newest committed, verified checkpoint (the one the ranks will load); skips the
    global samples between it and the anomaly (or ``rollback_skip_samples``); scales the LR by
    ``rollback_lr_scale``. Fails the stage after ``max_rollbacks`` within ``rollback_window_steps``.
    """
    from megatrain.checkpoint.restore import newest_restorable_step

    logger = run_logger()
    cfg = load_config(config_path)
    policy = cfg.reliability
    run_dir = cfg.train.run_dir
    anomaly_step = int(verdict["step"])
    # The triggered self-check (prefect.yaml) reads the stage's config and the nodes from here.
    resource = {"prefect.resource.id": f"megatrain.config.campaign.{campaign_id}", "megatrain.stage": stage,
                "megatrain.config.campaign": campaign_id, "megatrain.config": str(Path(config_path).resolve()),
                "megatrain.nodes": socket.gethostname()}

    history = read_rollbacks(run_dir)
    recent = [r for r in history if anomaly_step - r.anomaly_step < policy.rollback_window_steps]
    if len(recent) >= policy.max_rollbacks:
        emit_event(event="megatrain.anomaly.rollback_limit", resource=resource,
                   payload={"verdict": verdict, "history": [r.__dict__ for r in history]})
        raise RollbackLimitExceeded(
            f"{len(recent) + 1} anomalies within {policy.rollback_window_steps} steps (limit "
            f"{policy.max_rollbacks}); history: {_history_text(history)}; last: {verdict['message']}"
        )

    restore_step = newest_restorable_step(cfg.checkpoint.durable_url) or 0
    skip = policy.rollback_skip_samples
    if skip is None:  # the window the run consumed since the checkpoint, anomaly step included
        skip = (anomaly_step - restore_step) * cfg.train.global_batch_size
    record = RollbackRecord(
        restore_step=restore_step, anomaly_step=anomaly_step, skip_samples=skip,
        lr_scale=policy.rollback_lr_scale, kind=verdict["kind"], message=verdict["message"],
    )
    append_rollback(run_dir, record)
    emit_event(event=f"megatrain.anomaly.{record.kind}", resource=resource,
               payload={"restore_step": restore_step, "anomaly_step": anomaly_step, "skip_samples": skip,
                        "rollback": count, "message": record.message})
    create_markdown_artifact(
        f"### Rollback {count} in stage `{stage}`\n\n* anomaly: **{record.kind}** at step {anomaly_step}: "
        f"{record.message}\n* restored step: {restore_step}\n* skipped samples: {skip}\n"
        f"* LR scale: {record.lr_scale}\n",
        key=f"{campaign_id}-{stage}-rollback".lower().replace("_", "-").replace(".", "-"),
        description="anomaly-triggered rollback",
    )
    logger.warning("rollback %d: %s at step %d -> restore step %d, skip %d samples",
                   count, record.kind, anomaly_step, restore_step, skip)
    return record.__dict__
