"""A resume is exact or refused (``checkpoint/continuity.py``), in one process with the fake trainer
of ``checkpoint_fakes.py`` under the real LR schedule, checkpointer and restore.

- WSD extended after its decay began, or after it finished: refused in one line naming the step
  the decay began and the two ways on; extended while stable: the LRs of a run that was always
  this long.
- ``checkpoint.resume_lr=redecay|rewarm``: continuous from the LR the checkpoint's run had, and a
  later restart of the restarted run keeps the transition (from the durable store as from a copy
  with the same config).
- the anomaly detector's windows come back with the checkpoint.
- a data position of other data (re-sharded sources, same config) is refused as a mismatch before
  any weight changed, not a crash that every restart repeats.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import CheckpointMismatch
from megatrain.config import AnomalyConfig, load_config
from megatrain.errors import DeterministicError
from megatrain.optim import build_scheduler
from megatrain.optim.schedule import Schedule
from megatrain.reliability.anomaly import AnomalyDetector

from checkpoint_fakes import make_trainer, run

WSD = ["optim.schedule=wsd", "optim.lr=2e-2", "optim.min_lr=1e-4", "optim.warmup_steps=1", "optim.decay_fraction=0.4"]


def config(tmp_path, steps: int, *extra: str):
    return load_config(None, [f"train.steps={steps}", f"checkpoint.staging_dir={tmp_path / 'staging'}",
                              f"checkpoint.durable_url={tmp_path / 'durable'}", "checkpoint.interval=3",
                              "checkpoint.upload_backoff_s=0.05", *WSD, *extra])


def trainer_for(cfg, seed: int = 0):
    """The fake trainer, under the run's real LR schedule (the trainer's build_scheduler)."""
    trainer = make_trainer(cfg, seed=seed)
    for group in trainer.engine.optimizer.param_groups:
        group["lr"] = group["initial_lr"] = cfg.optim.lr
    trainer.engine.lr_scheduler = build_scheduler(trainer.engine.optimizer, cfg.optim, cfg.train.steps)
    trainer.anomaly = AnomalyDetector(AnomalyConfig(loss_window=5))
    return trainer


def train(cfg, until: int, trainer=None) -> list[float]:
    """Resume (or start) a run of ``cfg`` and train it to ``until``; the LR of each step trained."""
    trainer = trainer or trainer_for(cfg)
    checkpointer = Checkpointer(cfg, trainer.env, trainer.groups)
    trainer.step = checkpointer.restore(trainer)
    lrs = []
    try:
        while trainer.step < until:
            lrs.append(trainer.engine.optimizer.param_groups[0]["lr"])
            trainer.anomaly.observe(trainer.step, 1.0 + 0.01 * trainer.step)
            run(trainer, checkpointer, trainer.step + 1)
    finally:
        checkpointer.close()
    return lrs


def test_a_wsd_run_extended_after_its_decay_began_is_refused_naming_the_step_and_the_ways_on(tmp_path):
    train(config(tmp_path, 10), 9)  # decays over steps 6-9: saved at step 9, three decayed steps trained
    with pytest.raises(CheckpointMismatch) as refused:
        train(config(tmp_path, 20), 20)
    line = str(refused.value)
    assert "\n" not in line and isinstance(refused.value, DeterministicError)
    assert "resuming at step 9" in line and "its WSD decay began at step 6" in line, line
    assert "train.steps 10 -> 20" in line and "checkpoint.resume_lr=redecay" in line and "resume_lr=rewarm" in line
    assert "keep train.steps=10" in line
    # a finished run extended: the same
    train(config(tmp_path, 10), 10)
    with pytest.raises(CheckpointMismatch, match="resuming at step 10 .*decay began at step 6"):
        train(config(tmp_path, 20), 20)


def test_a_wsd_run_extended_while_stable_trains_as_a_run_that_was_always_that_long(tmp_path):
    straight = train(config(tmp_path / "straight", 20), 20)
    first = train(config(tmp_path / "resumed", 10), 6)  # saved at step 6: steps 0-5 warm-up and stable
    resumed = first + train(config(tmp_path / "resumed", 20), 20)
    assert resumed == straight
    assert straight == [Schedule.of(config(tmp_path, 20).optim, 20).at(s) for s in range(20)]


@pytest.mark.parametrize("mode", ["redecay", "rewarm"])
def test_an_explicit_transition_is_continuous_and_kept_by_later_restarts(tmp_path, mode):
    old = config(tmp_path, 10, "checkpoint.interval=4")
    before = train(old, 8)  # saved at step 8, mid-decay
    checkpoint_lr = Schedule.of(old.optim, 10).at(8)  # the LR step 8 would have had
    longer = config(tmp_path, 20, "checkpoint.interval=4", f"checkpoint.resume_lr={mode}", "checkpoint.rewarm_steps=3")
    after = train(longer, 14)  # resumed at 8, saved at 12, stopped at 14: a crash
    assert after[0] == pytest.approx(checkpoint_lr) and before[-1] > after[0] > 1e-4
    if mode == "redecay":
        assert after == sorted(after, reverse=True)
    else:
        assert after[3] == pytest.approx(2e-2) and after[:4] == sorted(after[:4])  # 3 steps back up
    # the restart after the crash resumes step 12 (same config): it keeps the transition
    again = train(longer, 20)
    straight = Schedule.of(longer.optim, 20).restarted(8, mode, checkpoint_lr, 3)
    assert after[:4] + again == pytest.approx([straight.at(s) for s in range(8, 20)], rel=1e-12)
    meta = (tmp_path / "durable" / "step-00000012" / "rank-00000.json").read_text()
    assert f'"mode": "{mode}"' in meta  # the history and the scheduler's function record it


def test_the_anomaly_windows_come_back_with_the_checkpoint(tmp_path):
    cfg = config(tmp_path, 20)
    trainer = trainer_for(cfg)
    train(cfg, 9, trainer)
    saved = list(trainer.anomaly.losses.values)
    assert len(saved) == 5  # steps 4-8 (loss_window 5)
    resumed = trainer_for(cfg, seed=3)
    checkpointer = Checkpointer(cfg, resumed.env, resumed.groups)
    assert checkpointer.restore(resumed) == 9
    checkpointer.close()
    assert list(resumed.anomaly.losses.values) == saved


class ReshardedLoader:
    """The real loader's contract when the data under the same config was sharded anew (its
    sources changed on disk): load_state_dict refuses a position of the old version."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __next__(self) -> torch.Tensor:
        return next(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("loader state has version='v-old', this loader has version='v-new'")


def test_a_data_position_of_other_data_is_a_mismatch_before_any_weight_changes(tmp_path):
    cfg = config(tmp_path, 20)
    train(cfg, 6)
    other = trainer_for(cfg, seed=5)
    other.loader = ReshardedLoader(other.loader)
    weights = {k: v.clone() for k, v in other.engine.module.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match="data position .*version='v-old', this loader has version='v-new'"):
        Checkpointer(cfg, other.env, other.groups).restore(other)
    assert all(torch.equal(v, other.engine.module.state_dict()[k]) for k, v in weights.items())


def test_a_checkpoint_that_predates_recorded_schedules_is_judged_at_its_resume_step(tmp_path):
    """Older checkpoints hold the scheduler's LR at their step, not the function: a resume whose
    LR there differs (the decay had begun) is refused all the same; one that matches goes on."""
    from megatrain.checkpoint.continuity import RunIdentity, judge_lr

    mine = RunIdentity.of(config(tmp_path, 20))
    meta0 = {"scheduler": {"last_epoch": 9, "_last_lr": [0.006], "base_lrs": [2e-2], "lr_lambdas": [None]},
             "schedule_fields": {"optim.lr": 2e-2}}
    with pytest.raises(CheckpointMismatch, match="resuming at step 9 .*LR 6.000e-03, this run's schedule gives 2.000e-02"):
        judge_lr(meta0, mine, "old")
    meta0["scheduler"]["_last_lr"] = [2e-2]
    assert not judge_lr(meta0, mine, "old").changed
