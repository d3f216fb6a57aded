"""One set of numbers: ``megatrain status``, the report, the flow's summary and the report's
TensorBoard scalars count attempts, faults, interrupts, tokens and tokens/s from one reading of a
stage's records (``megatrain/report/records.py``), and drop the rows of steps trained again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_campaign_report import ROOT_DIR

from megatrain.config import load_config
from megatrain.launch.ranks import write_run_config
from megatrain.observe.tensorboard import read_scalars
from megatrain.report.campaign import build_report
from megatrain.report.console import summary_lines
from megatrain.report.records import human_count, read_stage
from megatrain.report.runs import RESUME_COLOR, plot_loss, read_metrics
from megatrain.report.status import campaign_status, describe_data

TOKENS_PER_STEP = 1024


def row(step: int, step_time_s: float, **extra) -> dict:
    return {"step": step, "loss": 7.0 - step / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": TOKENS_PER_STEP * step,
            "step_time_s": step_time_s, "tokens_per_s": TOKENS_PER_STEP / step_time_s, "mfu": None, "phases_ms": {},
            **extra}


def stage_folder(campaign: Path, name: str, steps: int, previous: str | None = None) -> Path:
    stage = campaign / name
    overrides = [f"train.run_dir={stage}", f"checkpoint.durable_url={campaign / 'durable' / name}",
                 f"checkpoint.staging_dir={stage / 'staging'}", f"train.steps={steps}"]
    if previous:
        overrides.append(f"checkpoint.init_from={campaign / 'durable' / previous}")
    write_run_config(load_config(ROOT_DIR / "configs/tiny-cpu.yaml", overrides), stage / "config.yaml")
    return stage


def commit(campaign: Path, name: str, *steps: int) -> None:
    for step in steps:
        step_dir = campaign / "durable" / name / f"step-{step:08d}"
        step_dir.mkdir(parents=True)
        (step_dir / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))


def write_attempts(stage: Path, *attempts: dict) -> None:
    (stage / "logs").mkdir(exist_ok=True)
    for a in attempts:
        (stage / "logs" / f"attempt-{a['attempt']}.log").write_text(f"attempt {a['attempt']}\n")
    (stage / "attempts.jsonl").write_text("".join(json.dumps({
        "started": 0.0, "ended": 1.0, "log": str(stage / "logs" / f"attempt-{a['attempt']}.log"), **a}) + "\n"
        for a in attempts))


def interrupted_stage(tmp_path: Path) -> Path:
    """One stage of 8 steps: Ctrl-C in step 6 (rows 1-5 logged, step 4 committed), resumed from 4
    (its first row carries ``startup``), finished. The step times differ, so a median is not the
    stage's tokens/s."""
    campaign = tmp_path / "camp"
    stage = stage_folder(campaign, "only", 8)
    first = [row(s, t) for s, t in zip(range(1, 6), (2.0, 0.5, 0.5, 0.5, 0.5))]
    second = [row(5, 1.5, startup={"step": 5}), *(row(s, 0.25) for s in (6, 7, 8))]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    write_attempts(stage, {"attempt": 1, "status": "stopped", "message": "stopped (SIGINT)", "metrics_rows": 5},
                   {"attempt": 2, "status": "completed", "message": "", "metrics_rows": 9})
    (stage / "tb").mkdir()
    commit(campaign, "only", 4, 8)
    return campaign


def test_token_counts_read_as_people_write_them():
    assert [human_count(n) for n in (0, 999, 32_896, 999_999, 1_234_567, 4.5e9)] == [
        "0", "999", "32.9k", "1M", "1.23M", "4.5B"]
    assert describe_data({"web": {"tokens": 32_896, "epochs": 0}}) == "web 32.9k tok 0 ep"  # was "0.0M"


def test_status_report_summary_and_tensorboard_count_the_same_and_a_ctrl_c_is_no_fault(tmp_path):
    campaign = interrupted_stage(tmp_path)
    records = read_stage(campaign / "only")
    # the row of step 5 that the interrupted attempt logged is superseded by the resumed attempt's
    assert [(r["step"], r["attempt"]) for r in records.superseded] == [(5, 1)]
    assert [r["step"] for r in records.timeline] == list(range(1, 9)) == [r["step"] for r in read_metrics(campaign / "only")]
    assert records.tokens == 8 * TOKENS_PER_STEP
    seconds = 2.0 + 4 * 0.5 - 0.5 + 1.5 + 3 * 0.25  # steps 1-4, the redone step 5 (1.5 s), 6-8
    assert records.tokens_per_s == pytest.approx(8 * TOKENS_PER_STEP / seconds)
    assert [(r.step, r.attempt, r.after) for r in records.resumes] == [(4, 2, "stopped")]

    (stage,) = campaign_status(campaign).stages
    assert (stage.state, stage.attempts, stage.faults, stage.interrupts, stage.restarts) == ("done", 2, 0, 1, 0)
    assert stage.last_fault is None and stage.resumed_at == [4] and stage.superseded_rows == 1
    assert stage.tokens_per_s == pytest.approx(records.tokens_per_s) and stage.tokens == records.tokens

    # the flow hands its own history, which knows only this run's attempt: the records decide
    this_run = [{"stage": "only", "steps": 8, "attempts": 1, "restarts": 0, "rollbacks": 0,
                 "history": [{"status": "completed"}], "run_dir": str(campaign / "only")}]
    report = build_report(campaign, this_run)
    (shown,) = report.summary["stages"]
    assert (shown["attempts"], shown["interrupts"], shown["faults"], shown["tokens"]) == (2, 1, 0, 8 * TOKENS_PER_STEP)
    assert shown["tokens/s"] == round(records.tokens_per_s) and shown["steps"] == 8
    assert report.summary["faults"] == [] and [i["attempt"] for i in report.summary["interrupts"]] == [1]
    assert "## Attempts (0 faults detected, 1 interrupts)" in report.markdown
    assert f"| 8.19k | {round(records.tokens_per_s):,} | 2 |" in report.markdown

    lines = "\n".join(summary_lines(report.summary))
    assert "faults detected and recovered: 0" in lines and "interrupts (resumed from the last checkpoint): 1" in lines
    stage_line = next(line for line in lines.splitlines() if line.strip().startswith("only"))
    assert stage_line.split()[1:] == ["8", "6.2000", "-", "8.19k", f"{round(records.tokens_per_s):,}", "2", "0",
                                      "restarts,", "0", "rollbacks,", "1", "interrupts"]

    scalars = read_scalars(campaign / "report" / "tb")  # TensorBoard: the same numbers, at the stage's last step
    numbers = {tag.rsplit("/", 1)[1]: points for tag, points in scalars.items()}
    assert numbers["attempts"] == [(8, 2.0)] and numbers["interrupts"] == [(8, 1.0)] and numbers["faults"] == [(8, 0.0)]
    assert numbers["tokens"] == [(8, 8192.0)] and numbers["tokens_per_s"][0][1] == round(records.tokens_per_s)


def test_a_step_logged_again_supersedes_every_later_row_of_the_attempt_before(tmp_path):
    """A resumed attempt that has not yet reached the steps the attempt before it logged: those
    rows never led anywhere either (keeping each step's last row kept them as the stage's last)."""
    campaign = tmp_path / "camp"
    stage = stage_folder(campaign, "only", 8)
    rows = [*(row(s, 0.5) for s in range(1, 8)), row(5, 0.5, startup={"step": 5}), row(6, 0.5)]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in read_metrics(stage)] == [1, 2, 3, 4, 5, 6]
    (shown,) = campaign_status(campaign).stages
    assert shown.last_step == 6 and shown.loss == pytest.approx(6.4)


def test_the_loss_picture_draws_a_line_where_each_attempt_resumed(tmp_path):
    from matplotlib.image import imread

    campaign = interrupted_stage(tmp_path)
    pink = tuple(int(RESUME_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5))

    def pink_columns(png: Path) -> int:
        pixels = imread(png)[..., :3]
        close = (abs(pixels - pink) < 0.08).all(axis=-1)
        return int((close.sum(axis=0) > 100).sum())  # columns with a long pink run: a vertical line

    assert pink_columns(plot_loss({"only": campaign / "only"}, tmp_path / "resumed.png")) >= 1
    (campaign / "only" / "metrics.jsonl").write_text("".join(json.dumps(row(s, 0.5)) + "\n" for s in range(1, 9)))
    (campaign / "only" / "attempts.jsonl").unlink()
    assert pink_columns(plot_loss({"only": campaign / "only"}, tmp_path / "straight.png")) == 0


def test_an_attempt_killed_with_its_flow_counts_where_a_later_attempt_recorded(tmp_path):
    """Attempt 2's flow was SIGKILLed: its log exists, no row ended it; attempt 3 resumed and
    recorded. The stage had three attempts (the reader once counted two: an attempt without a row
    counted only after the last recorded one), and status and the report say three."""
    campaign = interrupted_stage(tmp_path)
    stage = campaign / "only"
    write_attempts(stage, {"attempt": 1, "status": "stopped", "message": "stopped (SIGINT)", "metrics_rows": 5},
                   {"attempt": 3, "status": "completed", "message": "", "metrics_rows": 9})
    (stage / "logs" / "attempt-2.log").write_text("attempt 2 (its flow was killed)\n")
    records = read_stage(stage)
    assert records.attempt_count == 3 and records.killed == [2] and records.unrecorded == []
    assert len(records.faults) == 0 and len(records.interrupts) == 1
    (status,) = campaign_status(campaign).stages
    assert status.attempts == 3
