"""The metrics logger decides what to print and write; the training loop only calls ``log``.

Rank 0 appends one JSON line per step to ``<run_dir>/metrics.jsonl`` and shows a rich progress
bar on a terminal, or a plain line every ``log_interval`` steps when output is not a TTY.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("megatrain")


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    mfu: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    startup: dict | None = None  # a process's first step only: its start-up breakdown (megatrain/startup.py)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, log_interval: int, enabled: bool = True):
        self.enabled = enabled
        self.log_interval = log_interval
        self.total_steps = total_steps
        self._progress = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def log(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        row = asdict(metrics)
        if row["startup"] is None:  # every other row stays as it was
            del row["startup"]
        self._file.write(json.dumps(row) + "\n")
        info = f"loss {metrics.loss:.4f}  {metrics.tokens_per_s:,.0f} tok/s"
        if metrics.mfu is not None:
            info += f"  MFU {100 * metrics.mfu:.1f}%"
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics.step, info=info)
        elif metrics.step % self.log_interval == 0 or metrics.step == self.total_steps:
            phases = " ".join(f"{k} {v:.0f}" for k, v in metrics.phases_ms.items())
            log.info("step %d/%d  %s  lr %.2e  gnorm %.3f  [ms: %s]", metrics.step, self.total_steps, info,
                     metrics.lr, metrics.grad_norm, phases)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled:
            self._file.close()
