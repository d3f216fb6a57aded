"""Append-only JSON lines after a writer was killed mid-row: the torn row is skipped, the next
attempt's rows are whole, and every reader (metrics, attempts, the campaign report) goes on."""

from __future__ import annotations

import json
import logging

from megatrain.observe.attempt_log import AttemptLog, read_attempts
from megatrain.observe.jsonl import open_append, read_rows
from megatrain.observe.metrics import MetricsLogger, StepMetrics
from megatrain.report.runs import read_metrics, read_raw_metrics, summarize_run


def row(step: int, loss: float) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, lr=1e-3, grad_norm=1.0, tokens=64 * step, step_time_s=0.1, tokens_per_s=640.0)


def test_a_row_torn_by_a_killed_writer_is_skipped_and_the_next_attempt_starts_a_new_line(tmp_path, caplog):
    first = MetricsLogger(tmp_path, total_steps=4, log_interval=100)
    first.log(row(1, 7.0))
    first._file.write('{"step": 2, "loss": 6.9, "l')  # SIGKILL here: half a row, no newline
    first._file.flush()
    second = MetricsLogger(tmp_path, total_steps=4, log_interval=100)  # the restarted attempt
    second.log(row(2, 6.8))
    second.log(row(3, 6.7))
    with caplog.at_level(logging.WARNING):
        rows = read_raw_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 7.0), (2, 6.8), (3, 6.7)]
    assert "metrics.jsonl: skipped 1 line(s)" in caplog.text and "line 2" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert summarize_run(tmp_path).final_loss == 6.7


def test_read_rows_skips_what_is_not_a_json_object(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\nnot json\n\n"text"\n{"b": 2}\n{"c":')
    assert read_rows(path) == [{"a": 1}, {"b": 2}]
    assert read_rows(tmp_path / "missing.jsonl") == []
    with open_append(path) as handle:  # the torn tail is closed before the next row
        handle.write(json.dumps({"d": 4}) + "\n")
    assert read_rows(path) == [{"a": 1}, {"b": 2}, {"d": 4}]


def test_attempts_survive_a_torn_row(tmp_path):
    (tmp_path / "attempts.jsonl").write_text('{"attempt": 1, "status": "crashed"}\n{"attempt": 2, "sta')
    log = AttemptLog(tmp_path, 3, forward=lambda line: None)
    log.close({"status": "completed", "message": ""})
    assert [(a["attempt"], a["status"]) for a in read_attempts(tmp_path)] == [(1, "crashed"), (3, "completed")]
