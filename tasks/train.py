"""Train one stage: launch its ranks, upload checkpoints as they are staged, recover from faults.

``train_stage`` is the resumable unit. Its result is persisted under a cache key built from the
campaign id, the stage, the stage's config fingerprint and the data version (never the run id),
so rerunning a campaign skips finished stages, and the interrupted one restarts its ranks, which
restore the last committed checkpoint themselves.

Inside a stage, each attempt is a ``launch-ranks`` task run; each staged checkpoint becomes its
own ``upload-checkpoint`` task run while training goes on; each anomaly becomes a ``rollback``
task run (and a Prefect event); a crash or hang re-runs the self-check before the restart.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from megatrain.campaign import CampaignConfig, stage_config
from megatrain.config_load import load_config
from tasks.checkpoint import staged_steps, upload_checkpoint
from tasks.rollback import RollbackLimitExceeded, rollback
from tasks._log import run_logger


class StageFailed(RuntimeError):
    pass


def _stage_cache_key(context, parameters) -> str:
    campaign: CampaignConfig = parameters["campaign"]
    index = parameters["index"]
    return "-".join([
        "stage", campaign.id, campaign.stages[index].name,
        stage_config(campaign, index).fingerprint(), parameters["data_version"],
    ])


@task(name="launch-ranks", retries=0, timeout_seconds=None)
def launch_ranks(config_path: str, nproc_per_node: int, attempt: int, timeout_s: float) -> dict:
    """Run the stage's ranks once (torchrun in its own session) and say how the attempt ended.

    ``timeout_seconds`` cannot interrupt a running thread, so the supervision (heartbeat watcher,
    wall-clock limit, process-group kill) lives in the engine's ``run_ranks``.
    """
    from megatrain.launch import run_ranks, torchrun_command
    from megatrain.observe.attempt_log import AttemptLog
    from megatrain.reliability.anomaly import clear_verdict, read_verdict
    from megatrain.reliability.watcher import HeartbeatWatcher

    logger = run_logger()
    cfg = load_config(config_path)
    run_dir = cfg.train.run_dir
    clear_verdict(run_dir)
    watcher = HeartbeatWatcher.from_config(cfg.reliability, run_dir, cfg.run_id, world_size=nproc_per_node)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    logger.info("attempt %d: %d ranks, run dir %s", attempt, nproc_per_node, run_dir)
    attempt_log = AttemptLog(run_dir, attempt, forward=logger.info)  # every line to files, the meaningful ones here

    def verdict():
        found = read_verdict(run_dir)
        return asdict(found) if found is not None else None

    def draw_who_hung(watch_result) -> None:
        from megatrain.observe.hang_view import Layout, grid_from_watch, plot_hang_grid, render_markdown
        from megatrain.observe.report import markdown_image

        dims = cfg.parallel
        layout = Layout(pp=dims.pp, dp=dims.data_parallel_size(nproc_per_node), tp=dims.tp)
        cells = grid_from_watch(watch_result, layout)
        png = plot_hang_grid(cells, layout, Path(run_dir) / f"hang-attempt{attempt}.png")
        create_markdown_artifact(f"### Who hung (attempt {attempt})\n\n{markdown_image(png, 'who hung')}\n\n"
                                 f"{render_markdown(cells, layout)}\n\n`{png}`",
                                 description="ranks by pipeline stage x data-parallel x tensor-parallel")

    try:
        result = run_ranks(
            torchrun_command(config_path, nproc_per_node), on_line=attempt_log, watcher=watcher,
            timeout_s=timeout_s, env=env, verdict_reader=verdict, on_fault=draw_who_hung,
            poll_s=min(1.0, cfg.reliability.heartbeat_interval_s),
        )
    finally:
        watcher.close()
    attempt_log.close(asdict(result))
    (logger.info if result.ok else logger.error)("attempt %d ended: %s after %.1f s. %s",
                                                attempt, result.status, result.wall_s, result.message)
    return asdict(result)


@task(name="train-stage", retries=0, persist_result=True, cache_key_fn=_stage_cache_key)
def train_stage(campaign: CampaignConfig, index: int, data_version: str) -> dict:
    from megatrain.launch import write_run_config

    logger = run_logger()
    stage = campaign.stages[index]
    cfg = stage_config(campaign, index)
    if campaign.launcher == "local":
        # The ranks only stage checkpoints; this task uploads and commits each one as a task run.
        # (On Kubernetes the staging disks are the nodes' own: each rank uploads its files.)
        cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"upload_mode": "external"})})
    config_path = str(write_run_config(cfg, campaign.stage_dir(index) / "config.yaml"))
    policy = cfg.reliability
    progress = create_progress_artifact(0.0, description=f"{campaign.id}: stage {stage.name}")
    shown_percent = 0

    history: list[dict] = []
    uploaded: set[int] = set()
    restarts = rollbacks = 0
    while True:
        attempt = len(history) + 1
        _upload_new(cfg, uploaded)  # staged before an earlier crash: commit it before the ranks restore
        launch = _launch(campaign, index, config_path, attempt)
        while not launch.state.is_final():
            _upload_new(cfg, uploaded)
            percent = 10 * (10 * _last_step(cfg.train.run_dir) // stage.steps)  # in tens: each update is an event
            if percent != shown_percent:
                update_progress_artifact(progress, float(percent))
                shown_percent = percent
            time.sleep(1.0)
        outcome = launch.result()
        _upload_new(cfg, uploaded)  # what was staged before a crash is still good
        history.append(outcome)
        if outcome["status"] == "completed":
            break
        if outcome["status"] == "anomaly":
            rollbacks += 1
            try:
                rollback(campaign.id, stage.name, config_path, outcome["verdict"], rollbacks)
            except RollbackLimitExceeded as exc:
                raise StageFailed(f"stage {stage.name}: {exc}") from None
            continue
        if outcome["status"] == "deterministic":  # a config, input or checkpoint error: no restart can help
            raise StageFailed(f"stage {stage.name}: {outcome['message']}")
        restarts += 1
        if restarts > policy.max_restarts:
            raise StageFailed(
                f"stage {stage.name}: {restarts - 1} restarts used up; last attempt {outcome['status']}: "
                f"{outcome['message']}"
            )
        logger.warning("stage %s attempt %d %s; restart %d/%d from the last committed checkpoint",
                       stage.name, attempt, outcome["status"], restarts, policy.max_restarts)
        if campaign.self_check:
            from tasks.selfcheck import run_self_check

            run_self_check(campaign)
    update_progress_artifact(progress, 100.0)
    return {
        "stage": stage.name, "steps": stage.steps, "attempts": len(history), "restarts": restarts,
        "rollbacks": rollbacks, "history": history, "run_dir": cfg.train.run_dir,
        "durable_url": cfg.checkpoint.durable_url, "checkpoints": sorted(uploaded),
    }


def _launch(campaign: CampaignConfig, index: int, config_path: str, attempt: int):
    """One attempt's ranks: torchrun here, or an indexed Job of nnodes pods on Kubernetes."""
    if campaign.launcher == "kubernetes":
        from tasks.kubernetes import launch_kubernetes_job, stage_manifests

        manifests = stage_manifests(campaign, index, attempt, Path(config_path).read_text(),
                                    image=os.environ.get("MEGATRAIN_IMAGE", "megatrain:latest"))
        return launch_kubernetes_job.submit(manifests, campaign.stage_timeout_s)
    return launch_ranks.submit(config_path, campaign.nproc_per_node, attempt, campaign.stage_timeout_s)


def _upload_new(cfg, uploaded: set[int]) -> None:
    """Submit one upload task run per staged step, and wait for them (in step order). An upload
    removes its staged dir, so a step found staged again was redone by a later attempt: the task
    keeps the committed copy when it verifies and replaces it when it does not."""
    for step in staged_steps(cfg.checkpoint.staging_dir):
        upload_checkpoint(cfg.checkpoint.staging_dir, cfg.checkpoint.durable_url, step,
                          cfg.checkpoint.keep_last, cfg.checkpoint.keep_every, cfg.train.run_dir)
        uploaded.add(step)


def _last_step(run_dir: str) -> int:
    """The last step in metrics.jsonl (progress only; cheap tail read)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = handle.read().decode(errors="ignore").strip().splitlines()
        import json

        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0
