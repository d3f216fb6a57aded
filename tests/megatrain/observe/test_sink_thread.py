"""The tracking sinks run off the training thread (megatrain/observe/sink_thread.py): a sink that
blocks does not block a step, rows arrive in order and all of them by close, and a sink's error
comes back to the training thread naming the sink."""

from __future__ import annotations

import threading

import pytest

from megatrain.observe.metrics import MetricsLogger, StepMetrics
from megatrain.observe.sink_thread import BackgroundSinks, SinkError


class Recording:
    def __init__(self, gate: threading.Event | None = None):
        self.rows: list[tuple[int, dict]] = []
        self.gate = gate
        self.threads: set[str] = set()
        self.closed = False

    def write(self, step, values):
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        self.rows.append((step, values))

    def close(self):
        self.closed = True


class Failing(Recording):
    def write(self, step, values):
        if step == 2:
            raise OSError("tracking server unreachable")
        super().write(step, values)


def test_a_blocked_sink_does_not_block_the_step_and_close_writes_every_row_in_order():
    gate = threading.Event()
    slow, fast = Recording(gate), Recording()
    sinks = BackgroundSinks([slow, fast])
    for step in range(1, 51):  # the slow sink is stuck on step 1: each write still returns
        sinks.write(step, {"loss": float(step)})
    assert slow.rows == []
    gate.set()
    sinks.close()
    want = [(step, {"loss": float(step)}) for step in range(1, 51)]
    assert slow.rows == want and fast.rows == want
    assert slow.closed and fast.closed
    assert slow.threads == {"metrics-sinks"}  # never the caller's thread


def test_a_failing_sink_is_raised_on_the_training_thread_naming_it_and_the_others_go_on():
    broken, healthy = Failing(), Recording()
    sinks = BackgroundSinks([broken, healthy])
    sinks.write(1, {"loss": 1.0})
    sinks.write(2, {"loss": 2.0})
    with pytest.raises(SinkError, match="metrics sink Failing: OSError: tracking server unreachable"):
        sinks.close()
    assert [step for step, _ in healthy.rows] == [1, 2]
    assert [step for step, _ in broken.rows] == [1]


def test_the_error_surfaces_at_the_next_write():
    broken = Failing()
    sinks = BackgroundSinks([broken])
    sinks.write(1, {"loss": 1.0})
    sinks.write(2, {"loss": 2.0})
    for _ in range(3000):  # until the thread has met the failing row (at most 30 s)
        if sinks._error is not None:
            break
        threading.Event().wait(0.01)
    with pytest.raises(SinkError, match="Failing"):
        sinks.write(3, {"loss": 3.0})
    sinks.close()


def test_the_metrics_logger_hands_its_rows_to_the_sinks_from_the_thread(tmp_path):
    sink = Recording()
    logger = MetricsLogger(tmp_path, total_steps=3, log_interval=1, sinks=[sink])
    for step in (1, 2, 3):
        logger.log(StepMetrics(step=step, loss=1.0 / step, lr=1e-3, grad_norm=0.5, tokens=64,
                               step_time_s=0.1, tokens_per_s=640.0))
    logger.close()
    assert [step for step, _ in sink.rows] == [1, 2, 3] and sink.closed
    assert sink.threads == {"metrics-sinks"}
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_a_sink_stuck_for_good_does_not_hold_the_run_s_end_and_is_named(caplog):
    gate = threading.Event()  # never opened: a tracking server that stopped answering
    stuck = Recording(gate)
    sinks = BackgroundSinks([stuck])
    for step in (1, 2, 3):
        sinks.write(step, {"loss": 1.0})
    with caplog.at_level("WARNING", logger="megatrain"):
        sinks.close(timeout_s=0.2)
    assert "metrics sinks ['Recording'] still writing" in caplog.text and "metrics.jsonl has every row" in caplog.text
    assert not stuck.closed
    gate.set()  # let the thread finish its row
