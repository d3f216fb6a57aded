"""Fault-matrix rows of the preflight, through the real ``pretrain`` flow: a durable store that is
read-only, and one too small for two checkpoints. Before the preflight, a read-only store was
noticed only at the first upload (EROFS retried for minutes, every step trained first); now
``validate-campaign`` probes every location a stage writes, and the flow fails within seconds,
before any rank starts, in one line naming the location and the bytes, without a retry.

Both disks are real filesystems (tmpfs: root needed, as this project's sandboxes and CI have; the
cases skip otherwise). Helpers and fixtures come from fault_matrix_common.py; run with ``-s`` to
see the rows' table.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from fault_matrix_common import (  # noqa: F401  (fixtures are found by name; fault_table, reproducible_cpu_math: autouse)
    TABLE, fault_table, logs, reproducible_cpu_math, workdir, write_campaign,
)

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.parallel.plan import checkpoint_size


def campaign_on(workdir: Path, campaign_id: str, shard_root: Path, durable: Path) -> Path:
    """The fault matrix's one-stage campaign, its durable store on ``durable``."""
    path = write_campaign(workdir, campaign_id, shard_url=shard_root)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "durable_url": str(durable)}, sort_keys=False))
    return path


def fails_before_any_rank(path: Path, logs, t_start: float) -> tuple[str, float]:
    """Run the campaign, which must fail at validate-campaign: returns (failure, seconds). No
    rank ever started (no attempt, heartbeat or metrics row) and the task was not retried."""
    from flows.pretrain import pretrain

    with pytest.raises(Exception) as failed:
        pretrain(str(path))
    seconds = time.time() - t_start
    stage_dir = Path(stage_config(load_campaign(path), 0).train.run_dir)
    for never in ("metrics.jsonl", "attempts.jsonl", "heartbeats", "logs"):
        assert not (stage_dir / never).exists(), never
    assert logs.find(r"attempt 1", after=t_start) is None and logs.find(r"launch-ranks", after=t_start) is None
    assert logs.find(r"Retry \d+/\d+ will start", after=t_start) is None  # deterministic: validate-campaign ran once
    return f"{type(failed.value).__name__}: {failed.value}", seconds


def preflight_row(fault: str, seconds: float, note: str) -> None:
    TABLE.append({"fault": fault, "detected by": "preflight in validate-campaign", "detection_s": round(seconds, 2),
                  "recovery_s": None, "attempts": 0, "restarts": 0, "rollbacks": 0, "bit_exact": None, "note": note})


@pytest.mark.slow
def test_read_only_durable_store(prefect_api, workdir, shard_root, logs, mount_tmpfs):
    with mount_tmpfs(workdir / "ro-durable", 64 * 2**20, read_only=True) as store:
        path = campaign_on(workdir, "ro-durable", shard_root, store)
        cfg = stage_config(load_campaign(path), 0)
        one = checkpoint_size(cfg, 1, 1, cuda=True).total  # train.dtype auto: bf16, the smaller checkpoint
        t_start = time.time()
        failure, seconds = fails_before_any_rank(path, logs, t_start)
    assert failure == (f"LocationNotWritable: checkpoint.durable_url {store}/only is not writable: OSError: [Errno 30] "
                       f"Read-only file system; it must hold two checkpoints (2 x {one} bytes): {2 * one} bytes "
                       f"({2 * one / 2**20:.1f} MiB), {64 * 2**20} bytes (64.0 MiB) free"), failure
    assert seconds < 30, seconds
    preflight_row("durable_read_only", seconds, "ro tmpfs as durable_url; flow Failed before any rank, no retry")


@pytest.mark.slow
def test_durable_store_too_small_for_two_checkpoints(prefect_api, workdir, shard_root, logs, mount_tmpfs):
    cfg = stage_config(load_campaign(write_campaign(workdir, "probe-size", shard_url=shard_root)), 0)
    one = checkpoint_size(cfg, 1, 1, cuda=True).total
    with mount_tmpfs(workdir / "small-durable", int(1.5 * one)) as store:  # room for one checkpoint, not two
        path = campaign_on(workdir, "small-durable", shard_root, store)
        t_start = time.time()
        failure, seconds = fails_before_any_rank(path, logs, t_start)
        assert list(store.iterdir()) == []  # the probe left nothing, not even the stage's folder
    match = re.fullmatch(rf"LocationTooSmall: checkpoint.durable_url {store}/only: too small for two checkpoints "
                         rf"\(2 x {one} bytes\): needs {2 * one} bytes \(\S+ MiB\), (\d+) bytes \(\S+ MiB\) free", failure)
    assert match and int(match.group(1)) < 2 * one, failure
    assert seconds < 30, seconds
    preflight_row("durable_too_small", seconds, "tmpfs of 1.5 checkpoints as durable_url; flow Failed before any rank")
