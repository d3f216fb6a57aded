"""Where a campaign stands, read from its directory alone (no Prefect, no torch).

A campaign dir (``runs/campaigns/<id>/``) holds one folder per stage with the stage's run config
(``config.yaml``), its ``metrics.jsonl``, ``attempts.jsonl`` (one row per ended attempt, written by
``megatrain.observe.attempt_log``) and ``rollbacks.json``; committed checkpoints sit under the
stage's ``checkpoint.durable_url``. Stages are ordered by their ``checkpoint.init_from`` chain
(each stage starts from the previous one's durable URL).

Used by ``megatrain status``, ``megatrain report CAMPAIGN_DIR``, ``megatrain checkpoints`` on a
campaign dir, and ``python -m flows.pretrain`` to say that a campaign is already finished.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatrain.config import read_yaml
from megatrain.config.campaign import DEFAULT_ROOT, find_campaign_dir, stage_dirs

RUNNING_WITHIN_S = 120  # metrics written this recently: the stage is (probably) still training


@dataclass
class StageStatus:
    name: str
    state: str  # done | running | stopped | pending
    target_steps: int
    last_step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # the last logged validation loss, when the run evaluates
    tokens_per_s: float | None = None  # median of the last 20 logged steps
    attempts: int = 0
    restarts: int = 0
    rollbacks: int = 0
    committed: list[int] = field(default_factory=list)
    last_fault: str | None = None
    run_dir: str = ""
    durable_url: str = ""
    logs: list[str] = field(default_factory=list)
    data: dict[str, dict] = field(default_factory=dict)  # per data component: samples, tokens, epochs so far


def describe_data(data: dict[str, dict]) -> str:
    """``web 1.2M tok 0 ep, code 0.7M tok 1 ep``: what each data component fed so far."""
    return ", ".join(f"{name} {stats['tokens'] / 1e6:.1f}M tok {int(stats['epochs'])} ep" for name, stats in data.items())


@dataclass
class CampaignStatus:
    id: str
    dir: str
    stages: list[StageStatus]

    @property
    def finished(self) -> bool:
        return all(s.state == "done" for s in self.stages)

    def as_dict(self) -> dict:
        return {"id": self.id, "dir": self.dir, "finished": self.finished, "stages": [asdict(s) for s in self.stages]}


def _last_fault(attempts: list[dict], rollbacks: list[dict]) -> str | None:
    faults = [a for a in attempts if a.get("status") != "completed"]
    if faults:
        last = faults[-1]
        return f"attempt {last['attempt']} {last['status']}: {last.get('message') or ''}".strip()
    if rollbacks:
        last = rollbacks[-1]
        return f"{last['kind']} at step {last['anomaly_step']} -> rolled back to step {last['restore_step']}"
    return None


def stage_status(stage_dir: Path, durable_url: str | None = None, target_steps: int | None = None) -> StageStatus:
    """One stage from its folder; ``durable_url`` and ``target_steps`` default to its config.yaml's."""
    import json

    from megatrain.checkpoint.catalog import committed
    from megatrain.observe.attempt_log import read_attempts
    from megatrain.report.runs import read_metrics

    stage_dir = Path(stage_dir)
    cfg = read_yaml(stage_dir / "config.yaml") if (stage_dir / "config.yaml").exists() else {}
    target = target_steps or int(cfg.get("train", {}).get("steps", 0))
    durable = durable_url or str(cfg.get("checkpoint", {}).get("durable_url", ""))
    rows = read_metrics(stage_dir)
    attempts = read_attempts(stage_dir)
    rollbacks_path = stage_dir / "rollbacks.json"
    rollbacks = json.loads(rollbacks_path.read_text()) if rollbacks_path.exists() else []
    steps = [info.step for info in committed(durable)] if durable else []
    val = [r for r in rows if r.get("val_loss") is not None]
    recent = [r["tokens_per_s"] for r in rows[-20:] if r.get("tokens_per_s")]
    metrics = stage_dir / "metrics.jsonl"
    if target and target in steps:
        state = "done"
    elif metrics.exists() and time.time() - metrics.stat().st_mtime < RUNNING_WITHIN_S:
        state = "running"
    else:
        state = "stopped" if rows or attempts else "pending"
    return StageStatus(
        name=stage_dir.name, state=state, target_steps=target,
        last_step=rows[-1]["step"] if rows else 0, loss=rows[-1]["loss"] if rows else None,
        val_loss=val[-1]["val_loss"] if val else None,
        tokens_per_s=statistics.median(recent) if recent else None,
        attempts=len(attempts), restarts=sum(a.get("status") in ("crashed", "hung", "timeout") for a in attempts),
        rollbacks=len(rollbacks), committed=steps, last_fault=_last_fault(attempts, rollbacks),
        run_dir=str(stage_dir), durable_url=durable,
        logs=[a["log"] for a in attempts if a.get("log")],
        data=next((r["data"] for r in reversed(rows) if r.get("data")), {}),
    )


def campaign_status(target: str | Path, root: str | Path | None = None) -> CampaignStatus:
    campaign_dir = find_campaign_dir(target, root)
    return CampaignStatus(id=campaign_dir.name, dir=str(campaign_dir),
                          stages=[stage_status(d) for d in stage_dirs(campaign_dir)])


def cli(argv: list[str]) -> int:
    """``megatrain status CAMPAIGN [--json]``: a campaign dir or id (under ``--root``)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="megatrain status", description="Where a campaign stands, at a glance.")
    parser.add_argument("campaign", help="campaign dir (runs/campaigns/<id>) or campaign id")
    parser.add_argument("--root", default=None, help=f"where campaign ids live (default {DEFAULT_ROOT})")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        status = campaign_status(args.campaign, args.root)
    except FileNotFoundError as exc:
        print(f"megatrain status: {exc}")
        return 2
    if args.json:
        print(json.dumps(status.as_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"campaign {status.id} ({'finished' if status.finished else 'not finished'})",
                  caption=status.dir)
    for column in ("stage", "state", "step", "loss", "val loss", "tokens/s", "data", "attempts", "checkpoints",
                   "last fault"):
        table.add_column(column, justify="right" if column in ("step", "loss", "val loss", "tokens/s", "attempts") else "left",
                         overflow="fold")
    colors = {"done": "green", "running": "cyan", "stopped": "yellow", "pending": "dim"}
    for stage in status.stages:
        table.add_row(
            escape(stage.name), f"[{colors[stage.state]}]{stage.state}[/]", f"{stage.last_step}/{stage.target_steps}",
            "-" if stage.loss is None else f"{stage.loss:.4f}", "-" if stage.val_loss is None else f"{stage.val_loss:.4f}",
            "-" if stage.tokens_per_s is None else f"{stage.tokens_per_s:,.0f}", escape(describe_data(stage.data) or "-"),
            f"{stage.attempts} ({stage.restarts} restarts, {stage.rollbacks} rollbacks)",
            ", ".join(map(str, stage.committed)) or "-", escape(stage.last_fault or "-"),
        )
    import sys

    (Console() if sys.stdout.isatty() else Console(width=160)).print(table)
    return 0
