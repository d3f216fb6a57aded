"""Fixtures of the checkpoint tests (the fake trainer lives in checkpoint_fakes.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from checkpoint_fakes import FakeTrainer, make_config, make_trainer

from megatrain.checkpoint.keeper_control import KeeperClient, KeeperError, keeper_dir
from megatrain.checkpoint.manager import Checkpointer
from megatrain.config import Config


@pytest.fixture
def fresh(tmp_path: Path):
    """(cfg, trainer, checkpointer) factory: one run dir (staging + durable) per ``run`` name."""
    made: list[Checkpointer] = []

    def factory(run: str = "run", **checkpoint: Any) -> tuple[Config, FakeTrainer, Checkpointer]:
        cfg = make_config(tmp_path / run, **checkpoint)
        trainer = make_trainer(cfg)
        checkpointer = Checkpointer(cfg, trainer.env, trainer.groups)
        made.append(checkpointer)
        return cfg, trainer, checkpointer

    yield factory
    for checkpointer in made:
        try:
            checkpointer.close()
        except Exception:  # an error the test provoked and asserted (close raises it again)
            pass


@pytest.fixture
def staging(tmp_path):
    """A staging dir for keeper tests; its keeper, if a test started one, is shut down after."""
    path = tmp_path / "staging"
    path.mkdir()
    yield path
    with contextlib.suppress(KeeperError):  # never leave a keeper behind, whatever the test did
        KeeperClient.connect(keeper_dir(path), timeout_s=0).request("shutdown")
