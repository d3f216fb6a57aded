"""A stage's records, read once: the numbers that ``megatrain status``, the campaign report, the
flow's closing summary and the report's TensorBoard scalars all show, so that they agree.

A stage's folder holds ``metrics.jsonl`` (a row per step, appended by every process that trained
it), ``attempts.jsonl`` (a row per ended attempt, ``observe.attempt_log``), ``logs/attempt-N.log``
and ``rollbacks.json``. What they mean, defined here and nowhere else:

- **attempt**: one launch of the stage's ranks. The stage's attempts are every attempt with a row
  in attempts.jsonl, plus one whose log file exists without a row (running, or its flow killed).
- **a row's attempt**: the rows up to an attempt's ``metrics_rows`` are its own; a process's first
  row (it carries ``startup``) or a step that goes back starts the rows of the next one.
- **superseded**: a row of steps that a later attempt trained again from an earlier checkpoint
  (after a crash, a Ctrl-C, a rollback). They never led to the final model: each reader drops
  them, as TensorBoard's reader drops the events a resumed attempt purges
  (``observe.tensorboard``). The rest is the stage's **timeline**, one row per step.
- **resume**: an attempt after the first that logged a row resumed from the step before its first
  row (the loss curve draws a line there), with the cause: how the attempt before it ended.
- **tokens**: the tokens of the timeline's steps; **train seconds**: the time those steps took
  (``step_time_s``: forward, backward, optimizer; not evaluation or checkpoint saving);
  **tokens/s** = tokens / train seconds. Redone steps count in neither.
- **fault**: an attempt that ended crashed, hung, timed out, in an anomaly or a deterministic
  error, or that the flow stopped because the stage failed. **interrupt**: an attempt stopped by
  a signal (Ctrl-C, SIGTERM) or a cancel: the operator's choice, not a fault.

Every path is read where the stage folder is now (``StageRecords.where``): a campaign moved,
copied or reached through a symlink reports its own files, never the recorded absolute ones.
No torch, no Prefect.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatrain.config.run_dirs import RunDir, is_url, read_run_dir

RESTARTED = ("crashed", "hung", "timeout")  # the outcomes the flow restarts
INTERRUPTED = "stopped"  # a signal or a cancel; "stopped (the stage failed)" is the flow giving up
STAGE_FAILED = "the stage failed"


def is_interrupt(attempt: dict) -> bool:
    return attempt.get("status") == INTERRUPTED and STAGE_FAILED not in (attempt.get("message") or "")


def is_fault(attempt: dict) -> bool:
    return attempt.get("status") not in ("completed", None) and not is_interrupt(attempt)


def human_count(value: float) -> str:
    """``987``, ``32.9k``, ``1.23M``, ``4.5B``: three significant digits, never ``0.0M`` for 32,896."""
    value = float(value)
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale * 0.9995:
            shown = value / scale
            return f"{shown:.3g}{suffix}" if shown < 1000 else f"{shown:,.0f}{suffix}"
    return f"{value:.0f}"


@dataclass
class Resume:
    step: int  # the step it resumed from (its first row is step + 1)
    attempt: int | None  # the attempt that resumed
    after: str  # how the attempt before it ended: crashed, stopped (an interrupt), anomaly, ...
    last_step: int  # the last step the attempts before it logged (where a fault hit)


@dataclass
class StageRecords:
    name: str
    run_dir: Path  # where the stage folder is now
    rows: list[dict] = field(default_factory=list)  # every metrics row, in file order, with "attempt" and "superseded"
    attempts: list[dict] = field(default_factory=list)  # attempts.jsonl, with "log" where the file is now
    rollbacks: list[dict] = field(default_factory=list)
    unrecorded: list[int] = field(default_factory=list)  # attempts with a log file and no row yet
    # attempts with a log file and no row before a recorded one: killed with their flow (SIGKILL,
    # a lost machine), so nothing ended them; they count, their steps are superseded by the next
    killed: list[int] = field(default_factory=list)
    run: RunDir | None = None
    # where the stage folder was when it wrote its records (absolute): its config's run dir, the
    # folders of the attempts' logs; a campaign moved between stages recorded more than one
    places: list[str] = field(default_factory=list)

    @property
    def timeline(self) -> list[dict]:
        """One row per step: the rows that led to the stage's final state."""
        return [row for row in self.rows if not row["superseded"]]

    @property
    def superseded(self) -> list[dict]:
        return [row for row in self.rows if row["superseded"]]

    @property
    def attempt_count(self) -> int:
        return len(self.attempts) + len(self.unrecorded) + len(self.killed)

    @property
    def faults(self) -> list[dict]:
        return [a for a in self.attempts if is_fault(a)]

    @property
    def interrupts(self) -> list[dict]:
        return [a for a in self.attempts if is_interrupt(a)]

    @property
    def restarts(self) -> int:
        return sum(a.get("status") in RESTARTED for a in self.attempts)

    @property
    def tokens(self) -> int:
        return round(sum(_step_tokens(row) for row in self.timeline))

    @property
    def train_seconds(self) -> float:
        return sum(float(row.get("step_time_s") or 0.0) for row in self.timeline)

    @property
    def tokens_per_s(self) -> float | None:
        seconds = self.train_seconds
        return self.tokens / seconds if seconds > 0 else None

    @property
    def resumes(self) -> list[Resume]:
        """Where each attempt after the first one that trained took up the stage's steps."""
        ended = {a.get("attempt"): a for a in self.attempts}
        restored = {r.get("restore_step") for r in self.rollbacks}
        found, previous = [], None
        for index, row in enumerate(self.rows):
            starts = index == 0 or "startup" in row or row["attempt"] != self.rows[index - 1]["attempt"] \
                or row["step"] <= self.rows[index - 1]["step"]
            if starts and index:
                after = str((ended.get(previous) or {}).get("status") or "")
                if not after:  # no attempts.jsonl (a run by hand): a rollback's restore step says it
                    after = "anomaly" if row["step"] - 1 in restored else "unknown"
                found.append(Resume(row["step"] - 1, row["attempt"], after, self.rows[index - 1]["step"]))
            if starts:
                previous = row["attempt"]
        return found

    def where(self, recorded: str) -> str:
        """A path this stage recorded, where it lies now: inside a folder the stage was in when it
        recorded something (``places``), the same place in the folder as it is now (moved,
        copied, symlinked); inside the campaign folder around it, the same place in the
        campaign folder now; a URL or a path elsewhere as recorded (``RunDir.where``)."""
        if not recorded or is_url(recorded) or not os.path.isabs(recorded):
            return self.run.where(recorded) if self.run is not None and recorded else recorded
        path = os.path.normpath(recorded)
        for outer in (False, True):  # the stage's own folder first, then the campaign's around it
            for place in self.places:
                old, now = (os.path.dirname(place), self.run_dir.parent) if outer else (place, self.run_dir)
                rel = os.path.relpath(path, old)
                if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
                    return str(now) if rel == "." else str(now / rel)
        return self.run.where(recorded) if self.run is not None else recorded


def _step_tokens(row: dict) -> float:
    """A step's own tokens: its rate times its time (each row's ``tokens`` is a running total)."""
    return float(row.get("tokens_per_s") or 0.0) * float(row.get("step_time_s") or 0.0)


def read_stage(stage_dir: str | Path, metrics_rows: list[dict] | None = None) -> StageRecords:
    """The stage's records from its folder. ``metrics_rows``: metrics.jsonl's parsed rows when the
    caller read the file already (``runs.read_jsonl``, which also names torn lines)."""
    from megatrain.observe.attempt_log import read_attempts
    from megatrain.observe.jsonl import read_rows

    stage_dir = Path(stage_dir)
    records = StageRecords(stage_dir.name, stage_dir, run=read_run_dir(stage_dir))
    parsed = read_rows(stage_dir / "metrics.jsonl") if metrics_rows is None else metrics_rows
    recorded = read_attempts(stage_dir)
    records.attempts = [{**a, "log": _log_here(stage_dir, a.get("log"))} for a in recorded]
    places = [records.run.recorded_path] if records.run else []
    places += [os.path.dirname(os.path.dirname(str(a["log"]))) for a in reversed(recorded) if a.get("log")]
    records.places = list(dict.fromkeys(os.path.normpath(p) for p in places if os.path.isabs(p)))
    records.rows = _mark_rows(parsed, records.attempts)
    try:
        found = json.loads((stage_dir / "rollbacks.json").read_text())
        records.rollbacks = [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []
    except (OSError, ValueError):
        records.rollbacks = []
    numbers = {a.get("attempt") for a in records.attempts}
    last_recorded = max((a for a in numbers if isinstance(a, int)), default=0)
    without_row = [n for n in _logged_attempts(stage_dir) if n not in numbers]
    records.unrecorded = [n for n in without_row if n > last_recorded]
    records.killed = [n for n in without_row if n < last_recorded]
    _number_unrecorded(records.rows, records.unrecorded)
    return records


def _log_here(stage_dir: Path, recorded: str | None) -> str | None:
    """An attempt's log lies in the stage's ``logs/`` (``AttemptLog``): its name there, now."""
    return str(stage_dir / "logs" / Path(recorded).name) if recorded else None


def _logged_attempts(stage_dir: Path) -> list[int]:
    logs = stage_dir / "logs"
    found = {int(m.group(1)) for p in (logs.glob("attempt-*.log") if logs.is_dir() else [])
             if (m := re.fullmatch(r"attempt-(\d+)\.log", p.name))}
    return sorted(found)


def timeline_of(parsed: list[dict]) -> list[dict]:
    """The timeline of metrics rows read already (no attempts known: the steps decide)."""
    return [row for row in _mark_rows(parsed, []) if not row["superseded"]]


def _mark_rows(parsed: list[dict], attempts: list[dict]) -> list[dict]:
    """Every row with an int step, as a copy with ``attempt`` (None: past every recorded attempt)
    and ``superseded`` (see the module docstring)."""
    ends = [(int(a["metrics_rows"]), a.get("attempt")) for a in attempts if isinstance(a.get("metrics_rows"), int)]
    rows: list[dict] = []
    timeline: list[dict] = []
    for index, row in enumerate(parsed):
        if not isinstance(row.get("step"), int):
            continue
        owner = next((number for end, number in ends if index < end), None)
        marked = {**row, "attempt": owner, "superseded": False, "_index": index}
        while timeline and timeline[-1]["step"] >= marked["step"]:  # trained again from an earlier step
            timeline.pop()["superseded"] = True
        timeline.append(marked)
        rows.append(marked)
    for row in rows:
        del row["_index"]
    return rows


def _number_unrecorded(rows: list[dict], unrecorded: list[int]) -> None:
    """Rows past every recorded attempt belong to the attempts that have a log and no row yet (a
    running one, or one whose flow was killed): each new process (``startup``) or step that goes
    back is the next of them."""
    numbers, current = list(unrecorded), None
    previous_step = None
    for row in rows:
        if row["attempt"] is not None:
            previous_step = row["step"]
            continue
        if current is None or "startup" in row or (previous_step is not None and row["step"] <= previous_step):
            current = numbers.pop(0) if numbers else current
        row["attempt"] = current
        previous_step = row["step"]
