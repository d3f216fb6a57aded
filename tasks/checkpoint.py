"""Upload and commit one staged checkpoint: each upload is its own, retried, task run."""

from __future__ import annotations

from prefect import task
from tasks._log import run_logger
from tasks._retry import unless_deterministic


def staged_steps(staging_dir: str) -> list[int]:
    """Steps whose stage-1 snapshot is complete on every rank (ready to upload), oldest first."""
    from megatrain.checkpoint.upload import ready_steps

    return ready_steps(staging_dir)


def check_storage_up(run_dir: str | None, durable_url: str) -> None:
    """Raise an OSError naming ``durable_url`` while an injected storage outage is active (the
    ``storage_outage`` fault writes its deadline under ``<run_dir>/faults``), so the task run
    fails and Prefect retries it, as it would for a real outage."""
    if run_dir is None:
        return
    from megatrain.reliability.faults import StorageOutage
    from megatrain.storage import StorageError

    outage = StorageOutage(run_dir)
    if outage.active():
        raise StorageError(durable_url, "durable storage unavailable (injected storage_outage)")


@task(name="upload-checkpoint", retries=5, retry_delay_seconds=[2, 4, 8, 16, 32], retry_condition_fn=unless_deterministic,
      timeout_seconds=3600)
def upload_checkpoint(staging_dir: str, durable_url: str, step: int, keep_last: int, keep_every: int | None = None,
                      run_dir: str | None = None) -> dict:
    """Copy the staged files to durable storage, verify size and sha256, write the manifest last
    (atomic rename): the checkpoint is committed or invisible, never half there. Then apply the
    retention policy (never deleting the newest committed checkpoint).

    A committed copy of the same step that no longer verifies (corrupted at rest) is replaced by
    this staged one. A full disk or an unsafe name fails at once (``unless_deterministic``). ``run_dir``: where an injected storage outage is announced (see
    ``check_storage_up``)."""
    from megatrain.checkpoint.retention import apply_retention
    from megatrain.checkpoint.upload import replace_if_corrupt, upload_staged_step

    logger = run_logger()
    check_storage_up(run_dir, durable_url)
    problems = replace_if_corrupt(durable_url, step)  # the engine's check, shared with "thread" mode
    if problems:
        logger.warning("committed step %d does not verify (%s); replacing it with the staged copy",
                       step, "; ".join(problems))
    result = upload_staged_step(staging_dir, durable_url, step)
    deleted = apply_retention(durable_url, keep_last, keep_every)
    logger.info("committed step %d to %s%s", step, durable_url, f"; retention deleted {deleted}" if deleted else "")
    return result
