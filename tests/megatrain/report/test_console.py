"""The demo's console: the filter on Prefect's console handler and the closing summary."""

from __future__ import annotations

import logging

from megatrain.report.console import ConsoleFilter, summary_lines


def record(message: str, task: str = "", level: int = logging.INFO) -> logging.LogRecord:
    rec = logging.LogRecord("prefect.task_runs", level, __file__, 1, message, None, None)
    if task:
        rec.task_run_name = task
    return rec


def test_console_keeps_faults_attempts_and_warnings_and_drops_progress():
    shown = ConsoleFilter().filter
    assert shown(record("attempt 1: 2 ranks, run dir /x", "launch-ranks-1a2"))
    assert shown(record("2026-11-24 09:35:14,790 [rank 1] WARNING megatrain.reliability.faults: injecting fault kill_rank", "launch-ranks-1a2"))
    assert not shown(record("rank 0: RuntimeError (traceback in /x/logs/attempt-1.rank0.log)", "launch-ranks-1a2"))
    assert shown(record("attempt 1 ended: crashed after 11.1 s. rank 1 SIGKILL", "launch-ranks-1a2", logging.ERROR))
    assert shown(record("2026-11-24 09:35:26,325 [rank 0] INFO megatrain: done: 40 steps, final loss 6.18", "launch-ranks-1a2"))
    assert shown(record("stage short-context: 40 steps, seq 64", "validate-campaign-699"))
    assert shown(record("vm gemm: 0.001 TFLOP/s (threshold 0.005) passed=False", "self-check-faa"))
    assert not shown(record("2026-11-24 09:35:47,671 [rank 0] INFO megatrain: step 30/40  loss 6.17", "launch-ranks-1a2"))
    assert not shown(record("committed step 20 to /x/durable", "upload-checkpoint-a12"))
    assert not shown(record("vm gemm: 0.195 TFLOP/s (threshold 0.005) passed=True", "self-check-faa"))
    assert not shown(record("Finished in state Completed()", "write-report-082"))
    assert shown(record("Finished in state Failed('boom')", "write-report-082"))
    # a failed attempt (a red task run) is one line on the console, not three
    failed = "attempt 1 crashed: rank 1 was killed by SIGKILL (exit code -9) in step 25"
    assert not shown(record(f"Task run failed with state: Failed(message='{failed}')", "launch-ranks-924", logging.ERROR))
    assert not shown(record(f"Finished in state Failed('{failed}')", "launch-ranks-924", logging.ERROR))


def test_a_line_every_rank_prints_shows_once():
    shown = ConsoleFilter().filter
    notice = "WARNING megatrain: rollback to step 10 after nan_loss at step 15: skipping 80 samples"
    assert shown(record(f"2026-11-24 09:45:31,126 [rank 0] {notice}", "launch-ranks-c5a"))
    assert not shown(record(f"2026-11-24 09:45:31,130 [rank 1] {notice}", "launch-ranks-c5a"))
    assert shown(record("2026-11-24 09:45:32,001 [rank 1] WARNING megatrain: something else", "launch-ranks-c5a"))


def test_summary_fits_one_screen_and_says_where_everything_is():
    report = {
        "campaign": "demo-1", "campaign_dir": "/runs/campaigns/demo-1", "finished": True,
        "stages": [{"stage": "short", "steps": 40, "final loss": 6.18, "val loss": 6.3, "tokens/s": 13800,
                    "attempts": 2, "restarts": 1, "rollbacks": 0}],
        "faults": [{"stage": "short", "attempt": 1, "status": "crashed", "message": "rank 1 exited on SIGKILL at step 25"}],
        "checkpoints": [{"url": "/runs/campaigns/demo-1/durable/short/step-00000040"}],
        "report": "/runs/campaigns/demo-1/report/report.md", "loss_curve": "/runs/campaigns/demo-1/report/loss.png",
        "tensorboard": "/runs/campaigns/demo-1",
    }
    lines = "\n".join(summary_lines(report)).splitlines()
    text = "\n".join(lines)
    assert len(lines) <= 16 and max(map(len, lines)) <= 140
    assert "6.3000" in text and "faults detected and recovered: 1" in text and "SIGKILL" in text
    for where in ("report.md", "loss.png", "step-00000040", "tensorboard --logdir /runs/campaigns/demo-1",
                  "megatrain status /runs/campaigns/demo-1"):
        assert where in text


def test_summary_shows_mfu_where_a_stage_has_it():
    row = {"stage": "full-context", "steps": 40, "final loss": 5.1, "val loss": None, "tokens/s": 61000,
           "attempts": 2, "restarts": 0, "rollbacks": 1}
    report = {"campaign": "gpu-1", "stages": [row], "faults": [], "checkpoints": [], "report": "r.md",
              "loss_curve": "loss.png"}
    assert "MFU" not in "\n".join(summary_lines(report))  # CPU: no peak, no column
    header, line = summary_lines({**report, "stages": [{**row, "MFU %": 41.7}]})[1:3]
    assert "MFU %" in header and "41.7" in line and line.index("41.7") < line.index("61,000") + 14
