"""What a real run logs per step, read back by the report's reader and by TensorBoard's: the LR
each step trained at, and the same steps and numbers in both after a crash and a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.megatrain.conftest import TINY, run_forked

from megatrain.config import load_config
from megatrain.observe.tensorboard import read_scalars
from megatrain.optim.schedule import Schedule
from megatrain.report.records import read_stage
from megatrain.report.runs import fault_marks

STEPS = 8


def overrides(run_dir: Path, shard_root: Path) -> list[str]:
    return [f"train.run_dir={run_dir}", f"data.shard_url={shard_root}", f"checkpoint.staging_dir={run_dir}/staging",
            f"checkpoint.durable_url={run_dir}/checkpoints", "model.n_layer=1", f"train.steps={STEPS}",
            "optim.warmup_steps=3", "optim.lr=1e-3", "optim.min_lr=1e-4", "checkpoint.interval=4",
            "train.log_interval=1"]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, shard_root) -> tuple[Path, list[str]]:
    """A run killed at the start of step 6 (steps 1-5 logged, step 4 checkpointed), then resumed
    to its end: step 5 is logged twice."""
    run_dir = tmp_path_factory.mktemp("logged") / "run"
    args = overrides(run_dir, shard_root)
    killed = run_forked(1, ["--config", str(TINY), *args, "reliability.faults=[{kind: kill_rank, step: 6}]"], 300)
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-2000:]
    resumed = run_forked(1, ["--config", str(TINY), *args], 300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    return run_dir, args


@pytest.mark.slow
def test_the_logged_lr_is_the_lr_the_step_trained_at(resumed_run):
    run_dir, args = resumed_run
    schedule = Schedule.of(load_config(TINY, args).optim, STEPS)
    timeline = read_stage(run_dir).timeline
    assert [r["step"] for r in timeline] == list(range(1, STEPS + 1))
    # step 1 of a 3-step warm-up trains at a third of the peak (the scheduler's next LR is two thirds)
    assert timeline[0]["lr"] == pytest.approx(1e-3 / 3)
    assert [r["lr"] for r in timeline] == pytest.approx([schedule.at(r["step"] - 1) for r in timeline])


@pytest.mark.slow
def test_tensorboard_and_the_report_keep_the_same_steps_and_count_the_same_tokens(resumed_run):
    run_dir, _ = resumed_run
    records = read_stage(run_dir)
    (resume,) = records.resumes
    assert resume.step in (0, 4)  # the newest committed checkpoint when the kill came (4, or none yet)
    superseded = [(r["step"], r["superseded"]) for r in records.rows if r["step"] > resume.step][:5 - resume.step]
    assert superseded == [(s, True) for s in range(resume.step + 1, 6)]  # the killed attempt's steps after it
    assert fault_marks(run_dir) == [("restart", 5, resume.step)]

    scalars = read_scalars(run_dir / "tb")  # TensorBoard's reader, after the resumed attempt's purge
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in records.timeline]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in records.timeline], rel=1e-6)
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([r["lr"] for r in records.timeline], rel=1e-6)
    rates, times = (dict(scalars[tag]) for tag in ("perf/tokens_per_s", "perf/step_time_s"))
    tokens = sum(rates[s] * times[s] for s in rates)
    assert records.tokens == pytest.approx(tokens, rel=1e-5) == STEPS * dict(scalars["train/tokens"])[1]
    assert records.tokens_per_s == pytest.approx(tokens / sum(times.values()), rel=1e-5)
