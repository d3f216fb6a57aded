"""Summaries of finished runs: per-run statistics from metrics.jsonl, and a loss curve.

Used by ``megatrain report RUN_DIR...`` and by the campaign flow's report task. No torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    first_loss: float
    final_loss: float
    tokens: int
    tokens_per_s: float  # median over steps after the first (the first pays for warm-up)
    mfu: float | None
    step_time_ms: float
    phases_ms: dict[str, float]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """One row per logged step; rows of steps that were redone after a restart or rollback
    replace the earlier ones, so the result is the run as it finally happened."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def summarize_run(run_dir: str | Path) -> RunSummary:
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl rows")
    steady = rows[1:] or rows
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    phases: dict[str, list[float]] = {}
    for row in steady:
        for name, ms in row.get("phases_ms", {}).items():
            phases.setdefault(name, []).append(ms)
    return RunSummary(
        run_dir=str(run_dir), steps=rows[-1]["step"], first_loss=rows[0]["loss"], final_loss=rows[-1]["loss"],
        tokens=rows[-1]["tokens"], tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
        mfu=statistics.median(mfus) if mfus else None,
        step_time_ms=1000 * statistics.median(r["step_time_s"] for r in steady),
        phases_ms={name: statistics.median(values) for name, values in phases.items()},
    )


def plot_loss(runs: dict[str, str | Path], path: str | Path) -> Path:
    """One loss curve per named run (stages of a campaign continue each other's step axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    offset = 0
    for name, run_dir in runs.items():
        rows = read_metrics(run_dir)
        if rows:
            ax.plot([offset + r["step"] for r in rows], [r["loss"] for r in rows], label=name)
            offset += rows[-1]["step"]
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain report", description="Summarise run directories.")
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--plot", help="write a loss curve PNG here")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        print(json.dumps(asdict(summarize_run(run_dir)), indent=2))
    if args.plot:
        print(f"loss curve: {plot_loss({Path(d).name: d for d in args.run_dirs}, args.plot)}")
    return 0
