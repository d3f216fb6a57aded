"""Upload and commit one staged checkpoint: each upload is its own, retried, task run."""

from __future__ import annotations

from prefect import task
from tasks._log import run_logger


def staged_steps(staging_dir: str) -> list[int]:
    """Steps whose stage-1 snapshot is complete on every rank (ready to upload), oldest first."""
    from megatrain.checkpoint.upload import ready_steps

    return ready_steps(staging_dir)


@task(name="upload-checkpoint", retries=5, retry_delay_seconds=[2, 4, 8, 16, 32], timeout_seconds=3600)
def upload_checkpoint(staging_dir: str, durable_url: str, step: int, keep_last: int, keep_every: int | None = None) -> dict:
    """Copy the staged files to durable storage, verify size and sha256, write the manifest last
    (atomic rename): the checkpoint is committed or invisible, never half there. Then apply the
    retention policy (never deleting the newest committed checkpoint)."""
    from megatrain.checkpoint.retention import apply_retention
    from megatrain.checkpoint.upload import upload_staged_step

    result = upload_staged_step(staging_dir, durable_url, step)
    deleted = apply_retention(durable_url, keep_last, keep_every)
    run_logger().info("committed step %d to %s%s", step, durable_url, f"; retention deleted {deleted}" if deleted else "")
    return result
