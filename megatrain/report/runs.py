"""Summaries of finished runs: per-run statistics from metrics.jsonl, and a loss curve.

Used by ``megatrain report RUN_DIR...`` (``cli.py``), the campaign report and the flow's report task. No torch.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatrain.observe.jsonl import read_rows


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    first_loss: float
    final_loss: float
    tokens: int
    tokens_per_s: float  # median over steps after the first (the first pays for warm-up)
    val_loss: float | None  # the last validation loss logged (None: the run does not evaluate)
    mfu: float | None
    step_time_ms: float
    phases_ms: dict[str, float]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """One row per logged step; rows of steps that were redone after a restart or rollback
    replace the earlier ones, so the result is the run as it finally happened."""
    by_step: dict[int, dict] = {}
    for row in read_raw_metrics(run_dir):
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def summarize_run(run_dir: str | Path) -> RunSummary:
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl rows")
    steady = rows[1:] or rows
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    phases: dict[str, list[float]] = {}
    for row in steady:
        for name, ms in row.get("phases_ms", {}).items():
            phases.setdefault(name, []).append(ms)
    return RunSummary(
        run_dir=str(run_dir), steps=rows[-1]["step"], first_loss=rows[0]["loss"], final_loss=rows[-1]["loss"],
        tokens=rows[-1]["tokens"], tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
        val_loss=val[-1] if val else None,
        mfu=statistics.median(mfus) if mfus else None,
        step_time_ms=1000 * statistics.median(r["step_time_s"] for r in steady),
        phases_ms={name: statistics.median(values) for name, values in phases.items()},
    )


STAGE_COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
RESTART_COLOR, ROLLBACK_COLOR = "#d62728", "#ff7f0e"


def read_raw_metrics(run_dir: str | Path) -> list[dict]:
    """Every logged row in the order written, redone steps included (where faults show)."""
    return [row for row in read_rows(Path(run_dir) / "metrics.jsonl") if isinstance(row.get("step"), int)]


def fault_marks(run_dir: str | Path) -> list[tuple[str, int, int]]:
    """(kind, step where the fault hit, step training resumed from) for each restart (a crashed,
    hung or timed-out attempt, from attempts.jsonl) and each rollback (from rollbacks.json). A
    run without attempts.jsonl falls back to where the logged steps went back."""
    run_dir = Path(run_dir)
    raw = read_raw_metrics(run_dir)
    path = run_dir / "rollbacks.json"
    marks = [("rollback", r["anomaly_step"], r["restore_step"]) for r in json.loads(path.read_text())] if path.exists() else []
    attempts = []
    if (run_dir / "attempts.jsonl").exists():
        attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines() if line.strip()]
    if attempts and all("metrics_rows" in a for a in attempts):
        for attempt in attempts:
            ended_at = attempt["metrics_rows"]
            if attempt.get("status") in ("crashed", "hung", "timeout") and 0 < ended_at <= len(raw):
                failed_at = raw[ended_at - 1]["step"]
                resumed = raw[ended_at]["step"] - 1 if ended_at < len(raw) else failed_at
                marks.append(("restart", failed_at, resumed))
        return sorted(marks, key=lambda mark: mark[1])
    restored = [m[2] for m in marks]
    for previous, row in zip(raw, raw[1:]):
        if row["step"] <= previous["step"] and row["step"] - 1 not in restored:
            marks.append(("restart", previous["step"], row["step"] - 1))
    return sorted(marks, key=lambda mark: mark[1])


def plot_loss(runs: dict[str, str | Path], path: str | Path, title: str = "") -> Path:
    """Training (solid) and validation (dashed) loss per stage on one step axis (stages continue
    each other's), restarts (red x) and rollbacks (orange v) marked where the stage went back."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    offset = 0
    for index, (name, run_dir) in enumerate(runs.items()):
        rows = read_metrics(run_dir)
        if not rows:
            continue
        color = STAGE_COLORS[index % len(STAGE_COLORS)]
        ax.plot([offset + r["step"] for r in rows], [r["loss"] for r in rows], color=color, linewidth=2,
                label=f"{name} (train)")
        val = [r for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot([offset + r["step"] for r in val], [r["val_loss"] for r in val], color=color, linestyle="--",
                    marker="o", markersize=3, label=f"{name} (validation)")
        by_step = {r["step"]: r["loss"] for r in rows}
        for kind, failed_at, resumed in fault_marks(run_dir):
            y = by_step.get(failed_at, by_step.get(resumed, rows[-1]["loss"]))
            mark = ("x", RESTART_COLOR) if kind == "restart" else ("v", ROLLBACK_COLOR)
            ax.plot([offset + failed_at], [y], marker=mark[0], color=mark[1], markersize=11, markeredgewidth=3,
                    linestyle="none", label=kind)
            ax.annotate(f"{kind} -> {resumed}", (offset + failed_at, y), textcoords="offset points", xytext=(4, 8),
                        color=mark[1], fontsize=8)
        if index:
            ax.axvline(offset, color="#999999", linestyle=":", linewidth=1)
        offset += rows[-1]["step"]
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per restart/rollback kind
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xlabel("step (stages in order)")
    ax.set_ylabel("loss")
    ax.set_title(title or "loss per stage")
    ax.grid(alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def markdown_image(png: str | Path, alt: str) -> str:
    """The PNG inline (a data: URI): Prefect's UI shows it in a markdown artifact, with no file
    path to follow and nothing to serve (checked in headless Chromium, tests/scripts)."""
    import base64

    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f"![{alt}](data:image/png;base64,{data})"
