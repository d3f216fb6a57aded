"""TensorBoard: one of the metrics logger's sinks (``megatrain/observe/metrics.py``).

Rank 0 writes the scalars of every step (training and validation loss, lr, grad norm, tokens/s,
MFU, phase times, checkpoint stall) as TensorBoard event files, by default in ``<run_dir>/tb``.
Open a run, or a whole campaign (each stage is a sub-directory there), with::

    .venv/bin/tensorboard --logdir runs/campaigns/<id>

``read_scalars`` reads event files back with TensorBoard's own event reader (tests, reports).

A run that restarts (a crash, a rollback) resumes from a checkpoint at step ``S``: the steps after
``S`` that the failed attempt logged never led to the final model. Each attempt opens its event
file with a ``SessionLog.START`` at ``S + 1`` (SummaryWriter's ``purge_step``), and TensorBoard's
reader then drops every older event from that step on: the curves show only the timeline that
led to the final state. The attempts stay visible in the report's loss curve, as markers.
"""

from __future__ import annotations

import time
from pathlib import Path

# imported only where TensorBoard is on (metrics.build_sinks imports this module lazily)
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class TensorBoardSink:
    """One event per step holding all of its scalars: a step's ~15 ``add_scalar`` calls cost
    0.8 ms on the training thread (an event each, serialized and checksummed by a writer thread
    whose 10-event queue they fill and wait on); one event holding them all costs 0.07 ms."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        """``purge_step``: the first step this attempt logs; what earlier attempts logged from it
        on is dropped by TensorBoard's reader (see the module docstring)."""
        self.log_dir = Path(log_dir)
        self.writer = EventFileWriter(str(self.log_dir), max_queue_size=100, flush_secs=10)
        if purge_step is not None:
            self.writer.add_event(Event(wall_time=time.time(), step=purge_step,
                                        session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, values: dict[str, float]) -> None:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self.writer.close()  # flushes what is queued


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under ``log_dir``: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}
