"""TensorBoard event files: written through the metrics logger, read back with TensorBoard's reader."""

import json

import pytest

from megatrain.observe.metrics import MetricsLogger, StepMetrics
from megatrain.observe.tensorboard import TensorBoardSink, read_scalars


def test_every_step_scalar_lands_in_event_files_and_reads_back(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    logger = MetricsLogger(tmp_path, total_steps=3, log_interval=1, sinks=[sink])
    for step in (1, 2, 3):
        logger.log(StepMetrics(
            step=step, loss=5.0 - step, lr=1e-3 * step, grad_norm=0.5 + step, tokens=100 * step, step_time_s=0.1,
            tokens_per_s=1000.0 + step, mfu=0.25, phases_ms={"forward": 10.0 * step, "checkpoint": 3.0},
            val_loss=4.5 - step if step == 3 else None, val_perplexity=2.0 if step == 3 else None,
            data={"web": {"samples": 6 * step, "tokens": 600 * step, "epochs": step // 3, "weight": 0.75},
                  "code": {"samples": 2 * step, "tokens": 200 * step, "epochs": 0, "weight": 0.25}},
        ))
    logger.close()

    scalars = read_scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert [v for _, v in scalars["perf/tokens_per_s"]] == [1001.0, 1002.0, 1003.0]
    assert scalars["phase_ms/forward"] == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert scalars["checkpoint/stall_ms"][0] == (1, 3.0)
    assert scalars["perf/mfu"][0] == (1, 0.25)
    assert scalars["val/loss"] == [(3, 1.5)]  # only where the evaluator ran
    assert scalars["data/web/tokens"] == [(1, 600.0), (2, 1200.0), (3, 1800.0)]  # what each component fed
    assert scalars["data/web/epochs"][-1] == (3, 1.0) and scalars["data/code/tokens"][-1] == (3, 600.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in rows] == [None, None, 1.5]  # the same path feeds metrics.jsonl


def test_a_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1, log_interval=1, enabled=False, sinks=[])
    logger.log(StepMetrics(1, 1.0, 1.0, 1.0, 1, 1.0, 1.0))
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
