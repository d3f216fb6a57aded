"""A run starting from another stage's checkpoint (checkpoint.init_from) under the stage rule
(megatrain/config/stage_change.py), judged on what the checkpoint recorded: a context extension is
said in one line of the ranks' log and the weights come along; a change of the model's shapes is
refused (CheckpointMismatch, deterministic) before any tensor is read, naming the field and both stages."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from checkpoint_fakes import make_trainer, run

from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import CheckpointMismatch
from megatrain.config import load_config
from megatrain.errors import DeterministicError


def stage(tmp: Path, name: str, *overrides: str, after: str | None = None):
    durable = tmp / "durable"
    return load_config(None, [
        f"checkpoint.staging_dir={tmp / name / 'staging'}", f"checkpoint.durable_url={durable / name}",
        *([f"checkpoint.init_from={durable / after}"] if after else []), "checkpoint.interval=3", "train.steps=100",
        "checkpoint.upload_backoff_s=0.05", "model.position=rope", "model.seq_len=512", "train.seq_len=64", *overrides])


@pytest.fixture
def short(tmp_path):
    """Stage short's final checkpoint (step 3) and its weights."""
    cfg = stage(tmp_path, "short")
    trainer = make_trainer(cfg)
    checkpointer = Checkpointer(cfg, trainer.env, trainer.groups)
    run(trainer, checkpointer, 3)
    checkpointer.close()
    return {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}


def start(cfg):
    trainer = make_trainer(cfg, seed=5)
    checkpointer = Checkpointer(cfg, trainer.env, trainer.groups)
    try:
        return trainer, checkpointer.restore(trainer)
    finally:
        checkpointer.close()


def test_a_context_extension_is_said_and_starts_from_the_weights(short, tmp_path, caplog):
    long = stage(tmp_path, "long", "train.seq_len=512", "model.rope_theta=500000", "model.attention_mask=document",
                 "model.rope_scaling={rope_type: yarn, factor: 8, original_max_position: 64}", after="short")
    with caplog.at_level(logging.INFO, logger="megatrain.checkpoint"):
        trainer, step = start(long)
    assert step == 0  # its own step count
    assert all((trainer.engine.module.state_dict()[k] == v).all() for k, v in short.items())
    lines = [r.getMessage() for r in caplog.records if "context extension" in r.getMessage()]
    assert lines == ["stage long: context extension from stage short: seq_len 64 -> 512, rope_theta 10000 -> "
                     "500000, rope_scaling none -> yarn (factor 8, original 64), attention_mask causal -> document"]


def test_a_shape_change_is_refused_before_any_tensor_is_read(short, tmp_path):
    wide = stage(tmp_path, "wide", "model.n_layer=3", after="short")
    with pytest.raises(CheckpointMismatch, match=r"stage wide: changes the model's shapes from stage short: "
                                                 r"model\.n_layer 12 -> 3") as raised:
        start(wide)
    assert isinstance(raised.value, DeterministicError)  # the ranks say it once and exit: no restart
