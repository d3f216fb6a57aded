"""Stage 2 across ranks: each rank uploads its own files, the commit waits for all of them."""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import STAGED, step_dir_name
from megatrain.checkpoint.snapshot import RankSnapshot, Snapshotter
from megatrain.checkpoint.upload import UploadError, mark_staged, upload_checkpoint, with_retries

LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "world_size": 2}


def _stage_two_ranks(staging, step: int = 10):
    for rank in (0, 1):
        snapshotter = Snapshotter(staging, torch.device("cpu"))
        files = {f"rank-{rank:05d}.safetensors": {"m": torch.full((100,), float(rank))}}
        marker = {"fingerprint": "f", "layout": LAYOUT, "coords": {"pp": 0, "dp": rank, "tp": 0},
                  "data_position": {"samples": 8 * rank}, "versions": {}}
        snapshotter.snapshot(RankSnapshot(step, rank, files, {f"rank-{rank:05d}.json": {"rank": rank}}, marker)).result()
        snapshotter.close()
    return staging / step_dir_name(step)


def test_commit_waits_for_every_rank(tmp_path):
    staged, durable = _stage_two_ranks(tmp_path / "staging"), str(tmp_path / "durable")
    with pytest.raises(UploadError, match=r"ranks \[1\] did not upload"):
        upload_checkpoint(staged, durable, ranks=[0], commit=True, commit_timeout_s=0.3, poll_s=0.05)
    assert catalog.committed(durable) == []
    # rank 0's committer waits in the background while rank 1 uploads (no collective involved)
    committer = threading.Thread(target=upload_checkpoint, args=(staged, durable),
                                 kwargs=dict(ranks=[0], commit=True, commit_timeout_s=30, poll_s=0.05))
    committer.start()
    upload_checkpoint(staged, durable, ranks=[1], commit=False)
    committer.join()
    (info,) = catalog.committed(durable)
    assert set(info.manifest["files"]) == {"rank-00000", "rank-00001"}
    assert info.manifest["data_position"] == {"0": {"samples": 0}, "1": {"samples": 8}}


def test_mark_staged_needs_every_rank(tmp_path):
    staged = _stage_two_ranks(tmp_path / "staging")
    assert mark_staged(staged, world_size=2, timeout_s=1)
    assert (staged / STAGED).exists()
    assert not mark_staged(staged, world_size=3, timeout_s=0.2)


def test_retries_back_off_exponentially(monkeypatch):
    sleeps, calls = [], []
    monkeypatch.setattr("megatrain.checkpoint.upload.time.sleep", sleeps.append)

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise OSError("down")
        return "ok"

    assert with_retries(flaky, "x", retries=5, backoff_s=1.0, max_backoff_s=3.0) == "ok"
    assert sleeps == [1.0, 2.0, 3.0]
    with pytest.raises(UploadError, match="gave up after 3 attempts"):
        with_retries(lambda: (_ for _ in ()).throw(OSError("down")), "x", retries=2, backoff_s=0.0)
