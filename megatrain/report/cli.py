"""``megatrain report``: a campaign's report (given its dir: report/report.md and the pictures), or
a summary of each run dir given (and their loss curve with ``--plot``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from megatrain.config.campaign import stage_dirs
from megatrain.report.campaign import build_report
from megatrain.report.console import summary_lines
from megatrain.report.runs import plot_loss, summarize_run


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatrain report",
        description="A campaign's report (given its dir: writes report/report.md and the pictures), "
                    "or a summary of each run dir.")
    parser.add_argument("dirs", nargs="+", help="a campaign dir (runs/campaigns/<id>), or run dirs")
    parser.add_argument("--plot", help="run dirs: write their loss curve PNG here")
    args = parser.parse_args(argv)
    if len(args.dirs) == 1 and Path(args.dirs[0]).is_dir() and stage_dirs(Path(args.dirs[0])):
        report = build_report(args.dirs[0])
        Path(report.summary["report"]).write_text(report.markdown)
        print("\n".join(summary_lines(report.summary)))
        return 0
    for run_dir in args.dirs:
        if not (Path(run_dir) / "metrics.jsonl").exists():
            print(f"megatrain report: {run_dir}: neither a campaign dir (stage folders with config.yaml) "
                  "nor a run dir (metrics.jsonl)")
            return 2
        print(json.dumps(asdict(summarize_run(run_dir)), indent=2))
    if args.plot:
        print(f"loss curve: {plot_loss({Path(d).name: d for d in args.dirs}, args.plot)}")
    return 0
