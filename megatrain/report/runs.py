"""Summaries of finished runs: per-run statistics from metrics.jsonl, and a loss curve.

Used by ``megatrain report RUN_DIR...`` (``cli.py``), the campaign report and the flow's report task. No torch.
"""

from __future__ import annotations

import statistics
import struct
from dataclasses import dataclass
from pathlib import Path

from megatrain.observe.jsonl import parse_rows, read_rows


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    first_loss: float
    final_loss: float
    tokens: int  # the tokens of the steps in the run's timeline (``records``)
    tokens_per_s: float  # those tokens over the time their steps took (``records``: the one definition)
    val_loss: float | None  # the last validation loss logged (None: the run does not evaluate)
    mfu: float | None
    step_time_ms: float
    phases_ms: dict[str, float]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """One row per logged step: the stage's timeline (``records``), without the rows of steps
    that were trained again after a restart, rollback or interrupt."""
    from megatrain.report.records import read_stage

    return _unmarked(read_stage(run_dir).timeline)


def final_rows(raw: list[dict]) -> list[dict]:
    """The timeline of rows read already (``read_metrics``'s rule: a step logged again supersedes
    every row from that step on), in step order."""
    from megatrain.report.records import timeline_of

    return _unmarked(timeline_of(raw))


def _unmarked(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("attempt", "superseded")} for row in rows]


@dataclass
class JsonlFile:
    """An append-only JSON-lines file as found: its rows, and what is wrong with it."""
    path: Path
    exists: bool
    rows: list[dict]  # every line that parses as a JSON object, in file order
    torn: list[int]  # numbers of the lines that do not (a write cut short)
    ends_torn: bool  # the file ends inside a row: its last line is torn and has no newline

    def problems(self, live: bool = False) -> list[str]:
        """``metrics.jsonl: last line torn (line 41)``; a live writer may be in the middle of its
        last line, so ``live`` leaves that one out."""
        torn = self.torn[:-1] if self.ends_torn and live else self.torn
        if not torn:
            return []
        if self.ends_torn and torn[-1] == self.torn[-1]:
            earlier = f"; also line {', '.join(map(str, torn[:-1][:5]))}" if len(torn) > 1 else ""
            return [f"{self.path.name}: last line torn (line {torn[-1]}, a write cut short){earlier}"]
        return [f"{self.path.name}: torn line {', '.join(map(str, torn[:5]))} skipped"]


def read_jsonl(path: str | Path) -> JsonlFile:
    """Like ``observe.jsonl.read_rows``, but says which lines were torn instead of only logging it
    (the status and the report name a damaged file; they never fail on one)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonlFile(path, False, [], [], False)
    lines = data.decode(errors="replace").splitlines()
    rows, torn = parse_rows(lines)
    ends_torn = bool(torn) and torn[-1] == len(lines) and not data.endswith(b"\n")
    return JsonlFile(path, True, rows, torn, ends_torn)


def event_file_problem(path: str | Path) -> str | None:
    """Why a TensorBoard event file is damaged, or None. The file is a sequence of TFRecords
    (8-byte length, 4-byte CRC, the event, 4-byte CRC); a writer killed mid-flush, or a copy cut
    short, leaves a last record that ends past the end of the file. (Only the framing is read:
    TensorBoard's own reader would stop at the cut without a word.)"""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return f"{path.name} is empty"
    offset = 0
    with path.open("rb") as handle:
        while offset < size:
            handle.seek(offset)
            header = handle.read(12)
            end = offset + 12 + (struct.unpack("<Q", header[:8])[0] + 4 if len(header) == 12 else 0)
            if len(header) < 12 or end > size:
                return f"{path.name} is truncated: its record at byte {offset} ends past the file's {size} bytes"
            offset = end
    return None


def tensorboard_problems(tb_dir: str | Path) -> list[str]:
    """What is missing or damaged in a run's TensorBoard folder (``<run_dir>/tb`` by default)."""
    tb_dir = Path(tb_dir)
    if not tb_dir.is_dir():
        return [f"TensorBoard folder {tb_dir} missing"]
    files = sorted(tb_dir.rglob("events.out.tfevents.*"))
    if not files:
        return [f"TensorBoard: no event file in {tb_dir}"]
    return [f"TensorBoard: {problem}" for problem in map(event_file_problem, files) if problem]


def summarize_run(run_dir: str | Path) -> RunSummary:
    from megatrain.report.records import read_stage

    records = read_stage(run_dir)
    rows = _unmarked(records.timeline)
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
        tokens=records.tokens, tokens_per_s=records.tokens_per_s or 0.0,
        val_loss=val[-1] if val else None,
        mfu=statistics.median(mfus) if mfus else None,
        step_time_ms=1000 * statistics.median(r["step_time_s"] for r in steady),
        phases_ms={name: statistics.median(values) for name, values in phases.items()},
    )


STAGE_COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
RESTART_COLOR, ROLLBACK_COLOR, RESUME_COLOR = "#d62728", "#ff7f0e", "#e377c2"


def read_raw_metrics(run_dir: str | Path) -> list[dict]:
    """Every logged row in the order written, redone steps included (where faults show)."""
    return [row for row in read_rows(Path(run_dir) / "metrics.jsonl") if isinstance(row.get("step"), int)]


def fault_marks(run_dir: str | Path) -> list[tuple[str, int, int]]:
    """(kind, step where the fault hit, step training resumed from) for each restart (a crashed,
    hung or timed-out attempt, from attempts.jsonl) and each rollback (from rollbacks.json). A
    run without attempts.jsonl counts each resume that no rollback explains as a restart."""
    from megatrain.report.records import RESTARTED, read_stage

    records = read_stage(run_dir)
    marks = [("rollback", r["anomaly_step"], r["restore_step"]) for r in records.rollbacks]
    marks += [("restart", resume.last_step, resume.step) for resume in records.resumes
              if resume.after in RESTARTED or resume.after == "unknown"]
    return sorted(marks, key=lambda mark: mark[1])


def plot_loss(runs: dict[str, str | Path], path: str | Path, title: str = "") -> Path:
    """Training (solid) and validation (dashed) loss per stage on one step axis (stages continue
    each other's), restarts (red x) and rollbacks (orange v) marked where the stage went back, and
    a pink dash-dot line at each step an attempt resumed from (after a fault or an interrupt)."""
    from megatrain.report.records import read_stage

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
        for resume in read_stage(run_dir).resumes:  # every attempt that took up the steps: a line where it did
            ax.axvline(offset + resume.step, color=RESUME_COLOR, linestyle="-.", linewidth=1, label="resume")
            cause = "interrupt" if resume.after == "stopped" else resume.after
            ax.annotate(f"resumed from {resume.step} ({cause})", (offset + resume.step, 1.0),
                        xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(2, -10),
                        rotation=90, va="top", color=RESUME_COLOR, fontsize=7)
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
