"""TensorBoard: one of the metrics logger's sinks (``megatrain/observe/metrics.py``).

Rank 0 writes the scalars of every step (training and validation loss, lr, grad norm, tokens/s,
MFU, phase times, checkpoint stall) as TensorBoard event files, by default in ``<run_dir>/tb``.
Open a run, or a whole campaign (each stage is a sub-directory there), with::

    .venv/bin/tensorboard --logdir runs/campaigns/<id>

``read_scalars`` reads event files back with TensorBoard's own event reader (tests, reports).
"""

from __future__ import annotations

from pathlib import Path


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under ``log_dir``: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}
