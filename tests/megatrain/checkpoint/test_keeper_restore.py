"""Restore from the checkpoint keeper, with the real trainer as 2 forked ZeRO ranks (gloo).

A run with RAM checkpoints every step and a durable one every 4 steps loses rank 1 to SIGKILL
(the kill_rank fault) at the start of step 7. The keeper outlives the ranks, so the relaunch
restores step 6 (or 5, when rank 1 died before its seal of step 6 reached the keeper) from host
memory, newer than the durable step 4; with rank 1's keeper copies corrupted, the same crash
restores from the durable store instead. Both end bit for bit where a fault-free run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from test_keeper_node_loss import (
    final_state as _final_state,  # step 8's; test_resume's is step 6's
)

from megatrain.checkpoint import catalog
from megatrain.checkpoint.memory import (
    KEEPER_IDLE_ENV,
    KeeperClient,
    KeeperError,
    keeper_dir,
)
from megatrain.launch.forked import CollectedRun, ForkLaunch
from megatrain.observe.jsonl import read_rows
from megatrain.reliability.keeper_faults import corrupt_keeper

REPO = Path(__file__).resolve().parents[3]
STEPS, INTERVAL, KILL_AT = 8, 4, 7


def _launch(run_dir: Path, shard_url: str, kill: bool = False) -> CollectedRun:
    overrides = [
        "model.n_layer=1", "model.dropout=0.1", f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}",
        "checkpoint.memory_interval=1", "data.max_source_bytes=300000", f"data.shard_url={shard_url}",
        "train.micro_batch_size=4", "train.log_interval=1000", f"train.run_dir={run_dir}",
        f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable",
        "data.prefetch_batches=0",
    ]
    # MKL/OpenMP on one thread: the same arithmetic in every run (bit-exact comparison)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEEPER_IDLE_ENV: "120"})
    env["MEGATRAIN_FAULTS"] = json.dumps([{"kind": "kill_rank", "step": KILL_AT, "rank": 1}]) if kill else ""
    return CollectedRun(ForkLaunch(["--config", "configs/tiny-cpu.yaml", *overrides], 2), env, REPO)


def _finish(run: CollectedRun) -> tuple[int, str]:
    code, out = run.finish(400)
    assert code is not None, "timed out: " + out[-3000:]
    return code, out


@pytest.fixture
def runs(tmp_path):
    names = {name: tmp_path / name for name in ("straight", "keeper", "corrupt")}
    yield names
    for run_dir in names.values():  # a failed test must not leave keepers holding memory
        with contextlib.suppress(KeeperError):
            KeeperClient.connect(keeper_dir(run_dir / "staging"), timeout_s=0).request("shutdown")


@pytest.mark.slow
def test_rank_killed_restores_from_keeper_or_durable_when_corrupt_bit_exact(runs, shard_url):
    first = [_launch(runs["straight"], shard_url), _launch(runs["keeper"], shard_url, kill=True),
             _launch(runs["corrupt"], shard_url, kill=True)]
    (code, out), *crashes = [_finish(proc) for proc in first]
    assert code == 0, out[-3000:]
    assert "memory checkpoint step 1: loop blocked" in out and "slot mapped" in out  # routine ones: DEBUG
    for crash_code, crash_out in crashes:
        assert crash_code != 0 and "injecting fault kill_rank on rank 1 at step 7" in crash_out, crash_out[-3000:]
    assert corrupt_keeper(runs["corrupt"] / "staging", rank=1)
    # Step 4's upload runs beside training: on a loaded machine rank 1 may die before it commits.
    durable = {name: [i.step for i in catalog.committed(str(runs[name] / "durable"))] for name in ("keeper", "corrupt")}

    second = [_launch(runs["keeper"], shard_url), _launch(runs["corrupt"], shard_url)]
    results = [_finish(proc) for proc in second]
    for code, out in results:
        assert code == 0, out[-3000:]
    keeper_row, = read_rows(runs["keeper"] / "restores.jsonl")
    assert keeper_row["tier"] == "keeper" and keeper_row["step"] in (5, 6), keeper_row
    assert keeper_row["durable_step"] == max(durable["keeper"], default=0)
    assert "from the keeper tier" in results[0][1]
    assert "rejected" in results[1][1] and "sha256 of chunk" in results[1][1]
    if durable["corrupt"] == [INTERVAL]:  # the durable tier, not the corrupt keeper copies
        corrupt_row, = read_rows(runs["corrupt"] / "restores.jsonl")
        assert corrupt_row["tier"] == "durable" and corrupt_row["step"] == INTERVAL, corrupt_row
    else:  # nothing durable yet: a start from scratch, never the corrupt copies
        assert durable["corrupt"] == [] and not (runs["corrupt"] / "restores.jsonl").exists()

    expected = _final_state(runs["straight"] / "durable")
    for name in ("keeper", "corrupt"):
        actual = _final_state(runs[name] / "durable")
        assert expected.keys() == actual.keys()
        different = [k for k in expected if not (torch.equal(expected[k], actual[k]) if torch.is_tensor(expected[k])
                                                 else expected[k] == actual[k])]
        assert not different, f"{name}: differ after resume: {different}"
    # every finished run shut its keeper down (asked at the rank's close; it removes its socket as it ends)
    sockets = [keeper_dir(run_dir / "staging") / "keeper.sock" for run_dir in runs.values()]
    deadline = time.monotonic() + 10
    while any(path.exists() for path in sockets) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(path.exists() for path in sockets), sockets
