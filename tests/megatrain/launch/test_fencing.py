"""The fencing epoch in a real Redis (launch/fencing.py): epochs only grow, a writer of an older
epoch is refused its check, commit and heartbeat (counted and listed), a current one is not; a Redis
restarted empty gets the fence back from the launcher's floor and from the current writer's next write."""

from __future__ import annotations

import json

import pytest

from megatrain.checkpoint.upload import UploadError, build_manifest
from megatrain.launch.fencing import Fence, StaleEpoch, issue_epoch, keys, read_log


def test_an_older_epoch_writes_nothing_and_a_restarted_store_fences_again(redis_url, run_id) -> None:
    first, _ = issue_epoch(redis_url, run_id)
    old = Fence(redis_url, run_id, first)
    old.check("upload")
    old.commit(2)
    second, fenced_at = issue_epoch(redis_url, run_id)
    assert second == first + 1
    new = Fence(redis_url, run_id, second)
    for attempt in (lambda: old.check("upload"), lambda: old.commit(4),
                    lambda: old.heartbeat(f"megatrain:{run_id}:hb", "w", "{}", 30, True)):
        with pytest.raises(StaleEpoch, match=f"epoch {first} is fenced by epoch {second}"):
            attempt()
    new.commit(4)
    new.heartbeat(f"megatrain:{run_id}:hb", "w", "{}", 30, True)
    log = read_log(redis_url, run_id)
    assert [(c["step"], c["epoch"]) for c in log["commits"]] == [(2, first), (4, second)]
    assert log["fenced"] == {"upload": 1, "commit": 1, "heartbeat": 1}
    assert all(r["epoch"] == first and r["time"] >= fenced_at for r in log["refused"])

    old.client.delete(keys(run_id)["epoch"])  # the store restarted empty: the old epoch would pass now ...
    new.check("upload")  # ... until the current writer's next write puts its epoch back
    with pytest.raises(StaleEpoch):
        old.check("upload")
    old.client.delete(keys(run_id)["epoch"])
    third, _ = issue_epoch(redis_url, run_id, floor=second)  # the launcher's epochs.jsonl: never 1 again
    assert third == second + 1
    for fence in (old, new):
        fence.close()


def test_a_commit_needs_every_marker_of_one_epoch() -> None:
    marker = {"step": 4, "fingerprint": "f", "layout": {"world_size": 2}, "coords": {"dp": 0, "tp": 0, "pp": 0},
              "files": {}}
    assert build_manifest({0: {**marker, "epoch": 3}, 1: {**marker, "epoch": 3}})["epoch"] == 3
    with pytest.raises(UploadError, match="epoch"):
        build_manifest({0: {**marker, "epoch": 3}, 1: {**marker, "epoch": 2}})
    assert "epoch" not in json.dumps(build_manifest({0: marker}))  # unfenced: as before
