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
import threading
import time
from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.states import Cancelled, Failed
from prefect.transactions import CommitMode, transaction

from megatrain.config.campaign import CampaignConfig, in_campaign_terms, stage_config
from megatrain.config import compat
from megatrain.config import load_config
from megatrain.errors import RanksRefused
from megatrain.observe.attempt_log import next_attempt
from tasks._artifacts import create_markdown_artifact  # secrets hidden
from tasks.checkpoint import staged_steps, upload_checkpoint
from tasks.keepers import stage_keepers
from tasks.rollback import RollbackLimitExceeded, rollback
from tasks._log import run_logger
from tasks.attempts import ABANDONED, abandoned_event, attempt_state, should_stop
from tasks.stop import STOP


class StageFailed(RuntimeError):
    pass


def _failed(message: str) -> Failed:
    """A failed stage: a red task run whose state message is the cause (no traceback)."""
    return Failed(message=message, data=StageFailed(message))


def _stage_cache_key(context, parameters) -> str:
    campaign: CampaignConfig = parameters["campaign"]
    index = parameters["index"]
    return "-".join([
        "stage", campaign.id, campaign.stages[index].name,
        compat.fingerprint(stage_config(campaign, index)), parameters["data_version"],
        *(["restart"] if campaign.stages[index].data_cursor == "restart" else []),  # replays: other samples
    ])


@task(name="launch-ranks", retries=0, timeout_seconds=None)
def launch_ranks(config_path: str, nproc_per_node: int, attempt: int, timeout_s: float) -> dict:
    """Run the stage's ranks once (torchrun in its own session) and say how the attempt ended.

    ``timeout_seconds`` cannot interrupt a running thread, so the supervision (heartbeat watcher,
    wall-clock limit, process-group kill) lives in the engine's ``run_ranks``.
    """
    from megatrain.launch.run_token import ensure_run_token
    from megatrain.launch.ranks import describe_root_cause, run_ranks
    from megatrain.observe.attempt_log import AttemptLog
    from megatrain.reliability.anomaly import clear_verdict, read_verdict
    from megatrain.reliability.watcher import HeartbeatWatcher

    logger = run_logger()
    cfg = load_config(config_path)
    run_dir = cfg.train.run_dir
    clear_verdict(run_dir)
    ensure_run_token()  # before the watcher and the ranks' env: only this run's ranks sign heartbeats it believes
    watcher = HeartbeatWatcher.from_config(cfg.reliability, run_dir, cfg.run_id, world_size=nproc_per_node)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    logger.info("attempt %d: %d ranks, run dir %s", attempt, nproc_per_node, run_dir)
    attempt_log = AttemptLog(run_dir, attempt, forward=logger.info)  # every line to files, the meaningful ones here

    def verdict():
        found = read_verdict(run_dir)
        return asdict(found) if found is not None else None

    def draw_who_hung(watch_result) -> None:
        from megatrain.report.hang_view import Layout, grid_from_watch, plot_hang_grid, render_markdown
        from megatrain.report.runs import markdown_image

        dims = cfg.parallel
        layout = Layout(pp=dims.pp, dp=dims.data_parallel_size(nproc_per_node), tp=dims.tp)
        cells = grid_from_watch(watch_result, layout)
        png = plot_hang_grid(cells, layout, Path(run_dir) / f"hang-attempt{attempt}.png")
        create_markdown_artifact(f"### Who hung (attempt {attempt})\n\n{markdown_image(png, 'who hung')}\n\n"
                                 f"{render_markdown(cells, layout)}\n\n`{png}`",
                                 description="ranks by pipeline stage x data-parallel x tensor-parallel")

    abandoned = abandoned_event(config_path)
    try:
        result = run_ranks(
            rank_launch(cfg, config_path, nproc_per_node), on_line=attempt_log, watcher=watcher,
            timeout_s=timeout_s, env=env, verdict_reader=verdict, on_fault=draw_who_hung,
            poll_s=min(1.0, cfg.reliability.heartbeat_interval_s),
            should_stop=should_stop(abandoned),
        )
        if result.root_cause is not None:  # name the step the first failed rank had reached
            step = _failed_step(watcher, run_dir, cfg.train.steps)
            result.root_cause["step"] = step
            result.message = describe_root_cause(result.root_cause, step)
    finally:
        watcher.close()
    return attempt_state(result, attempt, attempt_log, abandoned)


def rank_launch(cfg, config_path: str, nproc_per_node: int):
    """How this attempt's ranks start: from the warm standby set (reliability.warm_standby),
    forked from the launcher's warm server (CPU ranks on a machine without a GPU,
    reliability.fork_cpu_ranks), else torchrun."""
    from megatrain.launch.forked import ForkLaunch, forking_suits
    from megatrain.launch.ranks import torchrun_command
    from megatrain.launch.standby import StandbyLaunch

    if cfg.reliability.warm_standby:
        return StandbyLaunch(["--config", config_path], nproc_per_node)
    if cfg.reliability.fork_cpu_ranks and forking_suits(cfg.train.device):
        return ForkLaunch(["--config", config_path], nproc_per_node)
    return torchrun_command(config_path, nproc_per_node)


def _failed_step(watcher, run_dir: str, last: int) -> int:
    """The step the job was in when a rank failed: one past the newest finished step that any
    rank reported (heartbeats, which lag by up to an interval, and rank 0's metrics.jsonl); the
    data-parallel ranks step in lockstep, so that is the failed rank's step too."""
    try:  # this attempt's records only (a rank that died before beating keeps an older one)
        finished = [record.step for record in watcher.sink.read_all(watcher.world_size).values()
                    if record.timestamp >= watcher.since]
    except Exception:
        finished = []
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_mtime >= watcher.since:  # a row of this attempt
        finished.append(_last_step(run_dir))
    return min(last, max(finished, default=0) + 1)


@task(name="train-stage", retries=0, persist_result=True, cache_key_fn=_stage_cache_key)
def train_stage(campaign: CampaignConfig, index: int, data_version: str) -> dict:
    """Run attempts until the stage's final step is committed and verifies in its durable URL.

    Ends Completed (the result dict), Failed (red, the cause as the state message: restarts or
    rollbacks used up, a deterministic error, an upload that failed for good, a final step that
    is not durable) or Cancelled (a stop request: the ranks were stopped and what was staged is
    committed)."""
    from megatrain.launch.ranks import write_run_config

    cfg = stage_config(campaign, index)
    try:
        cursors = carried_data_cursors(campaign, index)
    except StageFailed as exc:
        return _failed(str(exc))
    if index > 0:  # what it changes of the stage whose final checkpoint it starts from (stage_change.py)
        change = campaign.stage_change(index)
        if change.refusal:  # validate-campaign refused it already; a campaign built otherwise too
            return Failed(message=change.refusal, data=RanksRefused(change.refusal))
        if change.line:
            run_logger().info(change.line)
        if cursors and change.seq_len[0] != change.seq_len[1]:
            # the shards are packed per seq_len and a cursor counts samples of one packing: the ranks
            # start each component at sample 0 of the new one (megatrain/data/position.py), said aloud here
            run_logger().warning(
                "stage %s: the data is re-packed at seq_len %s, so each data component starts at sample 0 of the "
                "new packing and may replay text stage %s trained on (a data cursor applies within one packing)",
                campaign.stages[index].name, change.seq_len[1], campaign.stages[index - 1].name)
    if cursors:  # each data component goes on where the previous stage left it (data_cursor: continue)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"cursors": cursors})})
    if campaign.launcher == "local":
        # The ranks only stage checkpoints; this task uploads and commits each one as a task run.
        # (On Kubernetes the staging disks are the nodes' own: each rank uploads its files.)
        cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"upload_mode": "external"})})
    config_path = str(write_run_config(cfg, campaign.stage_dir(index) / "config.yaml"))
    ABANDONED[config_path] = threading.Event()
    with stage_keepers(campaign, index, cfg):  # the nodes' keepers outlive the attempts' ranks, not the stage
        try:
            return _run_attempts(campaign, index, cfg, config_path)
        finally:  # whatever ended the stage (an upload failed for good, a bug): no rank trains on alone
            ABANDONED.pop(config_path).set()


def carried_data_cursors(campaign: CampaignConfig, index: int) -> dict | None:
    """The stage handoff of the data: where each component's own sample order stood at the
    previous stage's final step (its committed data position), for this stage's ``data.cursors``;
    None for the first stage and a ``data_cursor: restart`` one. The previous stage's final step
    is committed and verified before this stage runs (flows/pretrain.py)."""
    from megatrain import storage
    from megatrain.checkpoint.catalog import read_manifest
    from megatrain.checkpoint.files import step_dir_name
    from megatrain.config.data import DataCursor
    from megatrain.data.position import end_cursors

    if index == 0 or campaign.stages[index].data_cursor == "restart":
        return None
    previous = campaign.stages[index - 1]
    step_url = storage.join_url(campaign.stage_durable_url(index - 1), step_dir_name(previous.steps))
    positions = (read_manifest(step_url) or {}).get("data_position") or {}
    if positions.get("0") is None:  # every DP rank saves the same global position
        raise StageFailed(f"stage {campaign.stages[index].name}: stage {previous.name}'s final step {step_url} "
                          "records no data position to continue from (data_cursor: restart starts the data over)")
    return {name: DataCursor(**c) for name, c in end_cursors(positions["0"]).items()}


def _run_attempts(campaign: CampaignConfig, index: int, cfg, config_path: str):
    logger = run_logger()
    stage = campaign.stages[index]
    policy = cfg.reliability
    progress = create_progress_artifact(0.0, description=f"{campaign.id}: stage {stage.name}")
    shown_percent = 0

    history: list[dict] = []
    uploaded: set[int] = set()
    restarts = rollbacks = 0
    first_attempt = next_attempt(cfg.train.run_dir)  # a rerun numbers on from the stopped run's attempts
    while True:
        attempt = first_attempt + len(history)
        _upload_new(cfg, uploaded)  # staged before an earlier crash: commit it before the ranks restore
        if STOP.check_cancelled():
            return _stopped(stage.name, cfg, uploaded)
        launch = _launch(campaign, index, config_path, attempt)
        while not launch.state.is_final():
            STOP.check_cancelled()  # the launch thread sees the request and stops the ranks
            _upload_new(cfg, uploaded)
            percent = 10 * (10 * _last_step(cfg.train.run_dir) // stage.steps)  # in tens: each update is an event
            if percent != shown_percent:
                update_progress_artifact(progress, float(percent))
                _progress_event(campaign.id, stage.name, percent, _last_step(cfg.train.run_dir), stage.steps)
                shown_percent = percent
            time.sleep(1.0)
        outcome = _outcome(launch)
        _upload_new(cfg, uploaded)  # what was staged before a crash or a stop is still good
        history.append(outcome)
        if STOP.is_set():
            return _stopped(stage.name, cfg, uploaded)
        if outcome["status"] == "completed":
            break
        if outcome["status"] == "anomaly":
            rollbacks += 1
            try:
                rollback(campaign.id, stage.name, config_path, outcome["verdict"], rollbacks)
            except RollbackLimitExceeded as exc:
                return _failed(f"stage {stage.name}: {exc}")
            continue
        if outcome["status"] == "deterministic":  # a config, input or checkpoint error: no restart can help
            message = f"stage {stage.name}: {in_campaign_terms(outcome['message'], stage.name)}"
            return Failed(message=message, data=RanksRefused(message))  # exit 4, no "Resume:" (megatrain/cli.py)
        restarts += 1
        if restarts > policy.max_restarts:
            return _failed(f"stage {stage.name}: {restarts - 1} restarts used up; last attempt "
                           f"{outcome['status']}: {outcome['message']}")
        logger.warning("stage %s attempt %d %s; restart %d/%d from the last committed checkpoint",
                       stage.name, attempt, outcome["status"], restarts, policy.max_restarts)
        if campaign.self_check:
            from tasks.selfcheck import run_self_check

            run_self_check(campaign)
    problem = final_checkpoint_problem(cfg.checkpoint.durable_url, stage.steps)
    if problem:  # trained, but not durable: never reported done
        return _failed(f"stage {stage.name}: the ranks finished but {problem}")
    update_progress_artifact(progress, 100.0)
    _progress_event(campaign.id, stage.name, 100, stage.steps, stage.steps)
    return {
        "stage": stage.name, "steps": stage.steps, "attempts": len(history), "restarts": restarts,
        "rollbacks": rollbacks, "history": history, "run_dir": cfg.train.run_dir,
        "durable_url": cfg.checkpoint.durable_url, "checkpoints": sorted(uploaded),
    }


def _progress_event(campaign_id: str, stage: str, percent: int, step: int, steps: int) -> None:
    """The progress bar's update as an event people can read: `prefect deployment run --watch`
    prints an event's resource name, and the artifact's own update event names only its id."""
    emit_event(event="megatrain.stage.progress", payload={"percent": percent, "step": step, "steps": steps},
               resource={"prefect.resource.id": f"megatrain.config.campaign.{campaign_id}.{stage}",
                         "prefect.resource.name": f"stage {stage}: {percent}% (step {step} of {steps})"})


def final_checkpoint_problem(durable_url: str, step: int) -> str | None:
    """Why ``step`` is not durable under ``durable_url`` (not committed, unreadable manifest,
    files that fail their size or sha256), or None when it is committed and verifies."""
    from megatrain import storage
    from megatrain.checkpoint.catalog import read_manifest
    from megatrain.checkpoint.files import step_dir_name
    from megatrain.checkpoint.restore import verify_checkpoint

    step_url = storage.join_url(durable_url, step_dir_name(step))
    try:
        manifest = read_manifest(step_url)
    except (OSError, ValueError) as exc:
        return f"its final step {step} has an unreadable manifest ({exc})"
    if manifest is None:
        return f"its final step {step} is not committed at {step_url}"
    problems = verify_checkpoint(step_url, manifest)
    if problems:
        return f"its final step {step} does not verify: {'; '.join(problems)}"
    return None


def _outcome(launch) -> dict:
    """How an attempt ended: the launch task's outcome dict (its data on a Failed or Cancelled
    state too), or a crash naming the exception if the task itself raised."""
    try:
        value = launch.result(raise_on_failure=False)
    except Exception as exc:  # e.g. its result could not be read back
        value = exc
    if isinstance(value, dict):
        return value
    return {"status": "crashed", "returncode": None, "wall_s": 0.0, "verdict": None, "faulty_ranks": [],
            "root_cause": None, "message": f"launch task failed: {type(value).__name__}: {value}"}


def _stopped(stage_name: str, cfg, uploaded: set[int]) -> Cancelled:
    from megatrain.checkpoint.catalog import committed

    steps = [info.step for info in committed(cfg.checkpoint.durable_url)]
    message = (f"stage {stage_name} stopped ({STOP.reason}); committed steps {steps or 'none'}, "
               f"a rerun resumes from {steps[-1] if steps else 'the start'}")
    run_logger().warning(message)
    return Cancelled(message=message)


def _launch(campaign: CampaignConfig, index: int, config_path: str, attempt: int):
    """One attempt's ranks: torchrun here, nodes here or on hosts, or an indexed Job of nnodes pods on Kubernetes."""
    if campaign.launcher == "kubernetes":
        from tasks.kubernetes import launch_kubernetes_job, stage_manifests

        manifests = stage_manifests(campaign, index, attempt, Path(config_path).read_text(),
                                    image=os.environ.get("MEGATRAIN_IMAGE", "megatrain:latest"))
        return launch_kubernetes_job.submit(manifests, campaign.stage_timeout_s)
    # N node launchers (torchrun agents here, or each inside its host of the campaign's cluster), each node
    # checked first (shrink/grow: tasks/elastic.py)
    if campaign.nnodes > 1 or campaign.launcher == "hosts":
        from tasks.elastic import launch_nodes

        return launch_nodes.submit(campaign, index, config_path, attempt)
    return launch_ranks.submit(config_path, campaign.nproc_per_node, attempt, campaign.stage_timeout_s)


def _upload_new(cfg, uploaded: set[int]) -> None:
    """Run one upload task run per staged step (in step order); one that fails after its retries
    (``checkpoint.upload_retries``, backoff from ``upload_backoff_s``) fails the stage, and the
    stage's ranks are stopped. An upload removes its staged dir, so a step found staged again was redone
    by a later attempt: the task keeps the committed copy when it verifies and replaces it when
    it does not."""
    ckpt = cfg.checkpoint
    # retried with the checkpoint section's backoff; never from a cache (the same step staged
    # again after a restart must be checked and maybe replaced)
    delays = [min(ckpt.upload_backoff_max_s, ckpt.upload_backoff_s * 2 ** i) for i in range(ckpt.upload_retries)]
    upload = upload_checkpoint.with_options(cache_policy=NO_CACHE, retries=ckpt.upload_retries,
                                            retry_delay_seconds=delays or 0)
    for step in staged_steps(ckpt.staging_dir):
        args = (ckpt.staging_dir, ckpt.durable_url, step, ckpt.keep_last, ckpt.keep_every, cfg.train.run_dir)
        if STOP.is_set():  # a cancelled flow run may start no task run: commit it all the same
            upload.fn(*args)
        else:
            with transaction(commit_mode=CommitMode.EAGER):  # committed now: stays Completed if the stage fails
                upload(*args)
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
