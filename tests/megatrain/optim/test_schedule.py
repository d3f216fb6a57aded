"""The LR schedule as a function (``megatrain/optim/schedule.py``): what a resume may change.

A resume is exact when this run's schedule gives every step the checkpoint's run trained the LR it
had, and every step to come the LR of the checkpoint's schedule at this run's length. The
transitions a resume may ask for instead (redecay, rewarm) start from the LR the checkpoint's run
had at the resume step, so the LR is continuous."""

from __future__ import annotations

import pytest

from megatrain.config import OptimConfig
from megatrain.optim.schedule import Schedule, lr_at, resume_difference


def wsd(total: int, **fields) -> Schedule:
    cfg = OptimConfig(schedule="wsd", lr=2e-2, min_lr=1e-4, warmup_steps=2, **fields)
    return Schedule.of(cfg, total)


def test_the_curves_are_the_ones_lr_at_always_gave():
    cfg = OptimConfig(schedule="wsd", lr=2e-2, min_lr=1e-4, warmup_steps=2)
    assert [lr_at(s, cfg, 10) for s in range(10)] == [wsd(10).at(s) for s in range(10)]
    assert wsd(10).decay_start() == 8 and wsd(100).decay_start() == 80
    assert wsd(10).at(7) == 2e-2 and wsd(10).at(8) < 2e-2 and wsd(10).at(9) == pytest.approx(1e-4)


def test_a_wsd_run_extended_while_stable_is_exact_and_after_its_decay_began_it_is_not():
    # stopped at step 8 (steps 0-7 trained, all at the peak or warming up): a longer run is the same function
    assert resume_difference(wsd(10), wsd(20), 8) is None
    # stopped at step 9: step 8 was trained decaying, the 20-step schedule gives it the peak
    found = resume_difference(wsd(10), wsd(20), 9)
    assert found is not None and found.trained and found.step == 8
    assert found.checkpoint_lr == pytest.approx(wsd(10).at(8)) and found.this_lr == 2e-2
    # a finished run: the same
    assert resume_difference(wsd(10), wsd(20), 10).step == 8
    # the same decay given as steps rather than as a share: other fields, the same function
    assert resume_difference(wsd(10), wsd(10, decay_steps=2, decay_fraction=0.5), 9) is None
    # a lower peak after the resume is a step to come with another LR
    lower = Schedule.of(OptimConfig(schedule="wsd", lr=1e-2, min_lr=1e-4, warmup_steps=2), 10)
    assert resume_difference(wsd(10), lower, 0).trained is False
    assert resume_difference(wsd(10), lower, 3).trained is True  # step 0 warmed up towards the old peak


@pytest.mark.parametrize("mode", ["redecay", "rewarm"])
def test_a_transition_starts_at_the_lr_the_checkpoints_run_had(mode):
    old, resume = wsd(10, decay_fraction=0.4), 8  # decaying over steps 6-9: step 8 is mid-decay
    longer = wsd(20, decay_fraction=0.4)
    assert resume_difference(old, longer, resume).step == 6
    new = longer.restarted(resume, mode, old.at(resume), steps=3)
    assert 1e-4 < new.at(resume) == old.at(resume) < 2e-2  # continuous: the LR the step would have had
    assert [new.at(s) for s in range(resume)] == [longer.at(s) for s in range(resume)]
    lrs = [new.at(s) for s in range(resume, 20)]
    if mode == "redecay":
        assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == len(lrs) and lrs[-1] == pytest.approx(1e-4)
    else:  # linear back up to the schedule in 3 steps, then the 20-step WSD (stable, then its decay from 12)
        assert lrs[:4] == pytest.approx([old.at(resume) + (2e-2 - old.at(resume)) * i / 3 for i in range(4)])
        assert [new.at(s) for s in range(11, 20)] == [longer.at(s) for s in range(11, 20)]
    # a later resume of the restarted run keeps the restart
    assert resume_difference(new, longer, 12) is None
    # longer again: a rewarm's steps do not depend on the length, a redecay's (down by the end) do
    assert (resume_difference(new, wsd(30, decay_fraction=0.4), 12) is None) == (mode == "rewarm")
    record = Schedule.from_record(new.record())
    assert record == new and record.restarts[-1]["from_lr"] == old.at(resume)
