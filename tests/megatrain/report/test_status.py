"""``megatrain status`` and the report tell the truth from the files a stage leaves: a failed stage
is ``failed`` at once with its cause (however fresh its metrics), ``running`` only while a live
process holds a lease, and a missing or damaged file is named instead of read as no progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from test_campaign_report import ROOT_DIR, hold_lease, metrics_row

from megatrain.checkpoint.files import STAGED, step_dir_name
from megatrain.config import load_config
from megatrain.launch.ranks import write_run_config
from megatrain.report.campaign import build_report
from megatrain.report.status import campaign_status
from megatrain.report.status import cli as status_cli

NO_SPACE = "NoSpaceError: /data/staging: 2.1 GB free, 3.4 GB needed for step 20"


def one_stage(tmp_path: Path, steps: int = 40, committed: tuple[int, ...] = (), rows: int = 0,
              attempts: tuple[dict, ...] = ()) -> Path:
    """A campaign of one stage as the flow leaves it: config.yaml, ``rows`` metrics rows,
    attempts.jsonl and committed checkpoints (a manifest of no files is a committed step)."""
    campaign = tmp_path / "camp"
    stage = campaign / "only"
    overrides = [f"train.run_dir={stage}", f"checkpoint.durable_url={campaign / 'durable/only'}",
                 f"checkpoint.staging_dir={stage / 'staging'}", f"train.steps={steps}"]
    write_run_config(load_config(ROOT_DIR / "configs/tiny-cpu.yaml", overrides), stage / "config.yaml")
    if rows:
        (stage / "metrics.jsonl").write_text("".join(metrics_row(s, 7.0 - s / 100) + "\n" for s in range(1, rows + 1)))
    for step in committed:
        step_dir = campaign / "durable/only" / step_dir_name(step)
        step_dir.mkdir(parents=True)
        (step_dir / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    if attempts:
        (stage / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    return campaign


def attempt(number: int, status: str, message: str = "", rows: int = 0, ended: float | None = None, **extra) -> dict:
    return {"attempt": number, "status": status, "message": message, "metrics_rows": rows,
            "started": time.time() - 30, "ended": ended or time.time() - 5, "log": f"logs/attempt-{number}.log", **extra}


def test_a_stage_that_failed_on_a_full_disk_shows_failed_at_once_with_its_cause(tmp_path, capsys):
    campaign = one_stage(tmp_path, rows=19, attempts=(attempt(1, "deterministic", NO_SPACE, rows=19),))
    (stage,) = campaign_status(campaign).stages  # metrics.jsonl written a moment ago
    assert (stage.state, stage.last_fault) == ("failed", f"attempt 1 deterministic: {NO_SPACE}")
    assert status_cli([str(campaign)]) == 0
    table = capsys.readouterr().out
    assert "failed" in table and "NoSpaceError" in table and "running" not in table

    # live holders that began before the failure: the flow run that recorded it (still ending),
    # and someone training by hand in the stage's folder (the deterministic error was theirs)
    for directory, owner in ((campaign, "flow run of camp"), (campaign / "only", "megatrain train by hand")):
        hold_lease(directory, owner)
        lease = json.loads((directory / "lease.json").read_text())
        (directory / "lease.json").write_text(json.dumps({**lease, "started": time.time() - 60}))
    assert campaign_status(campaign).stages[0].state == "failed"
    hold_lease(campaign, "flow run of camp (a rerun)")  # started after the failure: it works on the stage
    assert campaign_status(campaign).stages[0].state == "running"


def test_running_only_while_a_live_process_holds_a_lease(tmp_path):
    crashed = attempt(1, "crashed", "rank 0 exited on SIGKILL at step 5", rows=4)
    campaign = one_stage(tmp_path, rows=4, attempts=(crashed,))
    stage_dir = campaign / "only"
    assert campaign_status(campaign).stages[0].state == "stopped"  # fresh metrics, nobody working on it
    hold_lease(stage_dir, "megatrain train of only")  # rank 0 trains (this process stands in for it)
    assert campaign_status(campaign).stages[0].state == "running"

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    hold_lease(stage_dir, "megatrain train of only", pid=dead.pid)  # rank 0 was killed: its lease stays
    hold_lease(campaign, "flow run 1234 of camp", pid=dead.pid)  # and so was the flow
    (stage,) = campaign_status(campaign).stages
    assert stage.state == "stopped"
    assert stage.last_fault.startswith(f"its flow process died: flow run 1234 of camp (pid {dead.pid} on ")
    assert stage.last_fault.endswith("before that attempt 1 crashed: rank 0 exited on SIGKILL at step 5")


def test_the_flows_give_up_rules_make_a_stage_failed(tmp_path):
    crashes = tuple(attempt(n, "crashed", f"rank 0 exited with code 1 at step {n}", rows=n) for n in range(1, 5))
    (stage,) = campaign_status(one_stage(tmp_path / "a", rows=4, attempts=crashes)).stages
    assert stage.state == "failed"  # reliability.max_restarts=3: the fourth crash ends the stage
    assert stage.last_fault == "3 restarts used up; attempt 4 crashed: rank 0 exited with code 1 at step 4"
    # a rerun (attempts count from 1 again) restarted once and was stopped: not failed
    rerun = (*crashes, attempt(1, "crashed", "boom", rows=4), attempt(2, "stopped", "stopped (SIGTERM) after 3.0 s"))
    assert campaign_status(one_stage(tmp_path / "b", rows=4, attempts=rerun)).stages[0].state == "stopped"

    spike = {"kind": "loss_spike", "step": 9, "value": 9.0, "baseline": 6.0, "message": "step 9: loss spike"}
    campaign = one_stage(tmp_path / "d", rows=9, attempts=(attempt(1, "anomaly", "loss spike", rows=9, verdict=spike),))
    records = [{"restore_step": 2, "anomaly_step": s, "skip_samples": 8, "lr_scale": 1.0, "kind": "loss_spike",
                "message": ""} for s in (3, 5, 7)]
    (campaign / "only/rollbacks.json").write_text(json.dumps(records))
    (stage,) = campaign_status(campaign).stages
    assert (stage.state, stage.last_fault) == ("failed", "4 anomalies within 1000 steps (limit 3); last: step 9: loss spike")
    (campaign / "only/rollbacks.json").write_text(json.dumps(records[:2] + [{**records[2], "anomaly_step": 9}]))
    assert campaign_status(campaign).stages[0].state == "stopped"  # rolled back: the flow went on

    upload = attempt(1, "stopped", "stopped (the stage failed) after 9.1 s", rows=2)
    campaign = one_stage(tmp_path / "c", rows=2, attempts=(upload,))
    staged = campaign / "only/staging" / step_dir_name(2)  # staged by the ranks, never uploaded
    staged.mkdir(parents=True)
    (staged / STAGED).write_text("{}")
    (stage,) = campaign_status(campaign).stages
    assert stage.state == "failed" and stage.last_fault == (
        "the flow failed the stage during attempt 1: staged step(s) [2] never committed (an upload that failed for good)")


def test_a_deleted_metrics_file_keeps_the_committed_progress_and_is_named(tmp_path, capsys):
    campaign = one_stage(tmp_path, committed=(20, 40), attempts=(attempt(1, "completed", rows=40),))
    (stage,) = campaign_status(campaign).stages
    assert (stage.state, stage.last_step, stage.notes) == ("done", 40, ["metrics.jsonl missing"])
    assert status_cli([str(campaign)]) == 0
    assert "40/40 (metrics.jsonl missing)" in capsys.readouterr().out
    report = build_report(campaign)
    assert report.summary["stages"][0]["steps"] == 40
    assert "`only`: metrics.jsonl missing" in report.markdown

    (campaign / "only/metrics.jsonl").write_text(metrics_row(1, 7.0) + "\n")  # cut to one row
    assert campaign_status(campaign).stages[0].notes == ["metrics.jsonl has 1 rows, 40 when an attempt ended (cut short)"]


def test_a_torn_metrics_line_and_missing_or_truncated_event_files_are_named(tmp_path):
    from megatrain.observe.tensorboard import TensorBoardSink

    campaign = one_stage(tmp_path, steps=8, committed=(8,), rows=8, attempts=(attempt(1, "completed", rows=8),))
    metrics = campaign / "only/metrics.jsonl"
    with metrics.open("a") as handle:
        handle.write('{"step": 9, "loss": 6.9, "l')  # a writer killed mid-row
    (stage,) = campaign_status(campaign).stages
    assert stage.state == "done" and stage.notes == ["metrics.jsonl: last line torn (line 9, a write cut short)"]
    report = build_report(campaign)
    assert "`only`: metrics.jsonl: last line torn (line 9" in report.markdown
    assert "`only`: TensorBoard folder" in report.markdown and "/only/tb missing" in report.markdown

    sink = TensorBoardSink(campaign / "only/tb")
    for step in range(1, 9):
        sink.write(step, {"loss": 7.0 - step / 100})
    sink.close()
    assert "TensorBoard" not in "".join(build_report(campaign).summary["problems"][0]["problems"])
    (event_file,) = (campaign / "only/tb").glob("events.out.tfevents.*")
    os.truncate(event_file, event_file.stat().st_size - 5)  # a copy cut short
    problems = build_report(campaign).summary["problems"][0]["problems"]
    assert f"TensorBoard: {event_file.name} is truncated" in problems[-1]
