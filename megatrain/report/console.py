"""The campaign's console: one screen for `make demo`, the full story in files and in Prefect.

``quiet_console()`` puts a filter on the console handler only (Prefect's API log handler, and with
it the UI, keeps every line the flow logs; the rank logs are files, see ``attempt_log``): the
ranks' INFO stream (step progress, staging), passed self-checks, committed uploads and
"Completed" task states stay off the console; faults, warnings, attempts and states other than
Completed stay on it. ``summary_lines(report)`` is what the flow prints at the end.
"""

from __future__ import annotations

import logging
import re

# Rank lines the console keeps although they are INFO: how an attempt ends. (A rank's traceback
# is one "traceback in <file>" line in the Prefect log; the console has the attempt's outcome.)
_RANK_KEEP = re.compile(r"\] (WARNING|ERROR|CRITICAL) |deterministic error|megatrain: done: ")
_RANK_STAMP = re.compile(r"^[\d-]+ [\d:,]+ \[rank \d+\] ")  # "2026-11-24 09:35:14,790 [rank 1] "


class ConsoleFilter(logging.Filter):
    """Also shows a line that every rank prints (a rollback notice) once, not once per rank."""

    def __init__(self) -> None:
        super().__init__()
        self._recent: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._worth_showing(record):
            return False
        same = _RANK_STAMP.sub("", record.getMessage())
        if same != record.getMessage():  # a rank's line: once for all ranks
            if same in self._recent:
                return False
            self._recent = [*self._recent[-31:], same]
        return True

    def _worth_showing(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        task = getattr(record, "task_run_name", "") or ""
        if record.levelno >= logging.WARNING and not task.startswith("launch-ranks"):
            return True
        if message.startswith("Finished in state Completed") or message.startswith("See https://docs.prefect.io"):
            return False
        if task.startswith("launch-ranks"):  # "attempt N ended: <cause>" is the fault's one line
            if message.startswith(("Task run failed with state", "Finished in state Failed")):
                return False
            return message.startswith("attempt ") or bool(_RANK_KEEP.search(message))
        if task.startswith("upload-checkpoint"):
            return False
        if task.startswith("self-check"):
            return "passed=True" not in message
        return True


def quiet_console() -> None:
    """Filter Prefect's console handler (on the root logger, set up when prefect is imported)."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not any(isinstance(f, ConsoleFilter) for f in handler.filters):
            handler.addFilter(ConsoleFilter())


def _num(value, fmt: str = "{:.4f}") -> str:
    return "-" if value is None else fmt.format(value)


def summary_lines(report: dict) -> list[str]:
    """The end of a campaign on one screen: a row per stage, the faults, where everything is. Its
    numbers are the report's (``campaign.build_report``), as ``megatrain status`` shows them."""
    from megatrain.report.records import human_count

    stages = report["stages"]
    state = "finished" if report.get("finished", True) else "not finished"
    mfu = any(row.get("MFU %") is not None for row in stages)  # known on a GPU (its peak), never on CPU
    lines = [f"\ncampaign {report['campaign']}: {state} ({len(stages)} stages)",
             f"  {'stage':<16}{'steps':>7}{'loss':>9}{'val loss':>10}{'tokens':>8}{'tokens/s':>10}"
             + (f"{'MFU %':>7}" if mfu else "") + f"{'attempts':>10}  faults"]
    for row in stages:
        faults = f"{row['restarts']} restarts, {row['rollbacks']} rollbacks"
        if row.get("interrupts"):
            faults += f", {row['interrupts']} interrupts"
        tokens = human_count(row["tokens"]) if row.get("tokens") else "-"
        lines.append(f"  {row['stage']:<16}{row['steps']:>7}{_num(row['final loss']):>9}{_num(row.get('val loss')):>10}"
                     f"{tokens:>8}{_num(row['tokens/s'], '{:,.0f}'):>10}"
                     + (f"{_num(row.get('MFU %'), '{:.1f}'):>7}" if mfu else "") + f"{row['attempts']:>10}  {faults}")
    faults = report.get("faults", [])
    lines.append(f"  faults detected{' and recovered' if report.get('finished', True) else ''}: {len(faults)}")
    lines += [f"    - {f['stage']}, attempt {f['attempt']}: {f['status']}: {f['message'][:110]}" for f in faults]
    interrupts = report.get("interrupts", [])
    if interrupts:  # a Ctrl-C or a cancel: the operator's, not a fault
        lines.append(f"  interrupts (resumed from the last checkpoint): {len(interrupts)}")
        lines += [f"    - {i['stage']}, attempt {i['attempt']}: {i['message'][:110]}" for i in interrupts]
    newest = report["checkpoints"][-1]["url"] if report["checkpoints"] else "-"
    lines += [f"  checkpoints: {len(report['checkpoints'])} committed, newest {newest}",
              f"  report:      {report['report']}",
              f"  loss curve:  {report['loss_curve']}"]
    if report.get("tensorboard"):
        lines.append(f"  TensorBoard: tensorboard --logdir {report['tensorboard']}")
    lines.append(f"  status:      megatrain status {report.get('campaign_dir', report['campaign'])}")
    return lines


def campaign_finished(campaign_path: str, overrides: list[str]) -> str | None:
    """A sentence saying the campaign is already finished (every stage's final step committed,
    the report written for this same config), or None when there is something to run."""
    from pathlib import Path

    from megatrain.config.campaign import load_campaign
    from megatrain.report.status import campaign_status

    campaign = load_campaign(campaign_path, overrides)
    report = campaign.campaign_dir / "report" / "report.json"
    if not report.exists() or not campaign.campaign_dir.is_dir():
        return None
    import json

    if json.loads(report.read_text()).get("fingerprint") != campaign.fingerprint():
        return None  # same id, other math: the flow decides (its cache keys hold the fingerprints)
    status = campaign_status(campaign.campaign_dir)
    if len(status.stages) != len(campaign.stages) or not status.finished:
        return None
    return (f"campaign {campaign.id} is already finished: every stage's final checkpoint is committed.\n"
            f"  report: {Path(report).with_name('report.md')}\n"
            f"  status: megatrain status {campaign.campaign_dir}\n"
            f"  to train again, give it a new id: id=<new id>")
