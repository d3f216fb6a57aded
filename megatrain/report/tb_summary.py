"""The campaign report's numbers in TensorBoard, beside the stages' step curves.

A campaign's TensorBoard logdir is the campaign folder: each stage's ``<stage>/tb`` holds its
per-step scalars (``observe.tensorboard``), and ``report/tb`` holds these, written by the report
from the same records as the report's table, ``megatrain status`` and the flow's summary
(``records``): per stage ``campaign/<stage>/<number>`` at the stage's last step. The report
rewrites them each time, so TensorBoard never shows a number the report no longer says.
"""

from __future__ import annotations

from pathlib import Path

# report row key -> scalar name
NUMBERS = {"steps": "steps", "tokens": "tokens", "tokens/s": "tokens_per_s", "attempts": "attempts",
           "faults": "faults", "interrupts": "interrupts", "restarts": "restarts", "rollbacks": "rollbacks",
           "final loss": "final_loss", "val loss": "val_loss"}


def summary_scalars(summary: dict) -> dict[str, tuple[int, float]]:
    """``campaign/<stage>/<number>`` -> (the stage's last step, value) from the report's rows."""
    out = {}
    for row in summary["stages"]:
        for key, name in NUMBERS.items():
            if row.get(key) is not None:
                out[f"campaign/{row['stage']}/{name}"] = (int(row["steps"] or 0), float(row[key]))
    return out


def write_summary_scalars(summary: dict, log_dir: str | Path) -> Path:
    """The report's numbers as one event file in ``log_dir`` (any earlier one removed first)."""
    from megatrain.observe.tensorboard import TensorBoardSink

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("events.out.tfevents.*"):
        old.unlink()
    sink = TensorBoardSink(log_dir)
    by_step: dict[int, dict[str, float]] = {}
    for tag, (step, value) in summary_scalars(summary).items():
        by_step.setdefault(step, {})[tag] = value
    for step, values in sorted(by_step.items()):
        sink.write(step, values)
    sink.close()
    return log_dir
