"""Which config changes keep a checkpoint usable (``megatrain.config.compat``: state / schedule fields).

Fast: the split of the fields. End to end (the real trainer, one process each): a run resumed
twice while extending ``train.steps``, changing the micro-batch at the same global batch and
turning activation checkpointing on has the losses of an uninterrupted run; a model-changing
override and an unflagged schedule change are refused naming the fields (exit 4, one line); with
``checkpoint.allow_schedule_change`` the change goes through and is recorded in the history.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatrain.config import Config
from megatrain.config.compat import schedule_fields, state_fields
from megatrain.errors import DETERMINISTIC_PREFIX, EXIT_DETERMINISTIC
from megatrain.launch.forked import run_module

REPO = Path(__file__).resolve().parents[3]


def test_state_and_schedule_fields_split_the_config():
    base = Config()
    kept = ["train.steps=7", "train.micro_batch_size=2", "model.activation_checkpointing=true", "model.compile=true",
            "model.kernels.attention=reference", "parallel.tp=2", "parallel.zero_stage=3", "checkpoint.interval=3",
            "reliability.max_restarts=9", "data.prefetch_batches=1", "train.log_interval=1"]
    from megatrain.config import load_config

    for override in kept:
        other = load_config(None, [override])
        assert state_fields(other) == state_fields(base), override
    for override, field in [("model.n_layer=3", "model.n_layer"), ("optim.name=adamw", "optim.name"),
                            ("train.seed=1", "train.seed"), ("data.seed=5", "data.seed"),
                            ("data.shuffle_shards=0", "data.shuffle_shards"), ("model.d_model=384", "model.d_model")]:
        other = load_config(None, [override])
        diff = {k for k in state_fields(base) if state_fields(base)[k] != state_fields(other)[k]}
        assert diff == {field}, override
    # the cosine length follows train.steps unless optim.decay_steps is set: extending changes the schedule
    longer = load_config(None, ["train.steps=200"])
    assert schedule_fields(longer)["optim.decay_steps"] == 200 != schedule_fields(base)["optim.decay_steps"]
    pinned = [schedule_fields(load_config(None, ["optim.decay_steps=100", f"train.steps={n}"])) for n in (100, 200)]
    assert pinned[0] == pinned[1]
    assert schedule_fields(load_config(None, ["train.global_batch_size=8"]))["train.global_batch_size"] == 8


def _train(run_dir: Path, shard_url: str, *overrides: str) -> subprocess.CompletedProcess:
    """One process of the real trainer (no torchrun; forked from the warm server) on tiny-cpu,
    checkpointing every 2 steps."""
    args = ["model.n_layer=2", "data.max_source_bytes=300000", f"data.shard_url={shard_url}", "data.prefetch_batches=0",
            "optim.decay_steps=6", "train.log_interval=1000", f"train.run_dir={run_dir}", "checkpoint.interval=2",
            f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_module("megatrain.train", ["--config", "configs/tiny-cpu.yaml", *args], env, REPO, timeout_s=300)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_extend_rebatch_and_checkpoint_activations_resume_like_one_run(tmp_path, shard_url):
    straight = tmp_path / "straight"
    _ok(_train(straight, shard_url, "train.steps=6", "train.micro_batch_size=8"))
    resumed = tmp_path / "resumed"
    _ok(_train(resumed, shard_url, "train.steps=2", "train.micro_batch_size=8"))
    # extend to 4 steps, micro-batch 4 (accumulation 2) at the same global batch of 8
    _ok(_train(resumed, shard_url, "train.steps=4", "train.micro_batch_size=4"))
    # extend to 6 steps, micro-batch 2 (accumulation 4), activation checkpointing on
    _ok(_train(resumed, shard_url, "train.steps=6", "train.micro_batch_size=2", "model.activation_checkpointing=true"))
    expected, got = _losses(straight), _losses(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    worst = max(abs(got[s] - expected[s]) for s in expected)
    print(f"max |loss difference| over 6 steps, resumed twice vs straight: {worst:.2e}")
    assert worst <= 1e-6, (got, expected)

    # a model-changing override is refused at once (exit 4), the field named with both values
    refused = _train(resumed, shard_url, "train.steps=8", "model.n_layer=3")
    assert refused.returncode == EXIT_DETERMINISTIC, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = next(x for x in refused.stderr.splitlines() if x.startswith(DETERMINISTIC_PREFIX))
    assert "CheckpointMismatch" in line and "model.n_layer: 2 -> 3" in line, line

    # a new global batch needs the flag; with it, the change is recorded in the checkpoint history
    refused = _train(resumed, shard_url, "train.steps=8", "train.global_batch_size=16")
    assert refused.returncode == EXIT_DETERMINISTIC
    assert "train.global_batch_size: 8 -> 16" in refused.stderr and "allow_schedule_change" in refused.stderr
    _ok(_train(resumed, shard_url, "train.steps=8", "train.global_batch_size=16", "checkpoint.allow_schedule_change=true"))
    meta = json.loads((resumed / "durable" / "step-00000008" / "rank-00000.json").read_text())
    (entry,) = meta["history"]
    assert entry["step"] == 6 and entry["schedule"] == {"train.global_batch_size": [8, 16]}
    assert entry["lr"][0] == pytest.approx(entry["lr"][1])  # a new batch size, the same LR at the resume step
    assert meta["loader"]["samples_consumed"] == 6 * 8 + 2 * 16


def test_a_checkpoint_written_before_a_knob_existed_still_matches_at_its_default():
    """State fields recorded by older code lack the knobs added since (the data section's
    mixture, unit_bytes, ...): they count as their defaults, so an upgrade strands no checkpoint -
    unless the run sets one away from it, or a field the checkpoint never knew is not a later knob."""
    from megatrain.checkpoint.restore import _differences
    from megatrain.config import compat, load_config

    mine = state_fields(load_config(REPO / "configs/tiny-cpu.yaml"))
    older = {k: v for k, v in mine.items() if k not in compat.later_knob_defaults()}
    assert len(older) < len(mine) and _differences(older, mine) == {}
    changed = state_fields(load_config(REPO / "configs/tiny-cpu.yaml", ["data.unit_bytes=1000000"]))
    assert _differences(older, changed) == {"data.unit_bytes": [64 << 20, 1000000]}
    assert _differences({k: v for k, v in mine.items() if k != "model.n_layer"}, mine) == {
        "model.n_layer": [None, mine["model.n_layer"]]}


@pytest.mark.slow
def test_extending_a_wsd_run_needs_no_schedule_change_and_a_cosine_one_says_how_its_lr_jumps(tmp_path, shard_url):
    """WSD: a run stopped in its stable phase and extended resumes at the same LR, with no flag;
    once its decay began, extending it is refused naming the step, or re-warmed on request.
    Cosine: extending stretches the curve; with the flag, the LR at the resume step jumps, and the
    log and the checkpoint history say from what to what."""
    common = ["optim.decay_steps=null", "optim.warmup_steps=1", "optim.lr=1e-3", "optim.min_lr=1e-4",
              "train.micro_batch_size=8"]
    wsd = tmp_path / "wsd"
    crash = 'reliability.faults=[{kind: kill_rank, step: 5}]'
    assert _train(wsd, shard_url, *common, "optim.schedule=wsd", "train.steps=8", crash).returncode != 0
    resumed = _train(wsd, shard_url, *common, "optim.schedule=wsd", "train.steps=16")
    _ok(resumed)
    rows = {row["step"]: row for row in map(json.loads, (wsd / "metrics.jsonl").read_text().splitlines())}
    assert [rows[s]["lr"] for s in (4, 5, 6)] == pytest.approx([1e-3] * 3)  # stable across the extension
    assert "changed schedule" not in resumed.stderr + resumed.stdout
    # finished (its decay over steps 13-15 trained): extending it again is refused in one line (exit 4) ...
    refused = _train(wsd, shard_url, *common, "optim.schedule=wsd", "train.steps=24")
    assert refused.returncode == EXIT_DETERMINISTIC, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = next(x for x in refused.stderr.splitlines() if x.startswith(DETERMINISTIC_PREFIX))
    assert "resuming at step 16" in line and "its WSD decay began at step 13" in line, line
    assert "checkpoint.resume_lr=redecay" in line and "checkpoint.resume_lr=rewarm" in line, line
    # ... or re-warmed explicitly: from the LR the run ended at, back to the 24-step schedule in one step
    # (a row's lr is the one its step trained at: row 17's is the LR of the resumed step)
    _ok(_train(wsd, shard_url, *common, "optim.schedule=wsd", "train.steps=24", "checkpoint.resume_lr=rewarm"))
    rows = {row["step"]: row for row in map(json.loads, (wsd / "metrics.jsonl").read_text().splitlines())}
    assert [rows[s]["lr"] for s in (16, 17, 18)] == pytest.approx([1e-4, 1e-4, 1e-3])

    cosine = tmp_path / "cosine"
    _ok(_train(cosine, shard_url, *common, "train.steps=4"))
    before = _losses(cosine)
    extended = _train(cosine, shard_url, *common, "train.steps=8", "checkpoint.allow_schedule_change=true")
    _ok(extended)
    meta = json.loads((cosine / "durable" / "step-00000008" / "rank-00000.json").read_text())
    (entry,) = meta["history"]
    old_lr, new_lr = entry["lr"]
    assert entry["step"] == 4 and new_lr > 2 * old_lr, entry  # the stretched cosine is high again at step 4
    assert f"from {old_lr:.3e}" in extended.stdout + extended.stderr and f"to {new_lr:.3e}" in extended.stdout + extended.stderr
    # and the campaign report's "Changes on resume" says it too
    from megatrain.report.campaign import _resume_changes_markdown, resume_changes

    changes = resume_changes(str(cosine / "durable"), [4, 8])
    assert changes == meta["history"]
    said = "\n".join(_resume_changes_markdown([{"stage": "cosine", **change} for change in changes]))
    assert f"`cosine` resumed at step 4: schedule `" in said and f"LR {old_lr:.3e} -> {new_lr:.3e}" in said, said
    assert sorted(before) == [1, 2, 3, 4]
