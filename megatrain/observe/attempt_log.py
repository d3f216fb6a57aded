"""What one attempt of a stage printed: every line to files, the meaningful ones to the operator.

The launcher streams the ranks' merged stdout/stderr line by line. ``AttemptLog`` is that stream's
sink: it writes every line, unfiltered, to ``<run_dir>/logs/attempt-<n>.log`` (and the lines a rank
marked as its own to ``attempt-<n>.rank<r>.log``), and forwards to the Prefect log only what an
operator reads: known third-party noise (DeepSpeed's banners, FutureWarnings) is dropped, and a
traceback becomes one line naming the rank, the exception and the file that holds it in full.
When the attempt ends, ``close(outcome)`` appends one row to ``<run_dir>/attempts.jsonl``, which
``megatrain status`` reads.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

from megatrain.observe.jsonl import open_append, read_rows
from megatrain.observe.redact import redact

# Third-party lines that say nothing about this run (each seen on every launch).
NOISE = [
    re.compile(p) for p in (
        r"untested optimizer, proceed with caution",
        r"Setting accelerator to CPU",
        r"^[WI]\d{4} \d\d:\d\d:\d\d",           # torchrun's glog-style info/warning lines
    )
]
WARNING = re.compile(r"\w+Warning: ")  # a Python warning; the next (indented) line is its source line
GLOG_ERROR = re.compile(r"^E\d{4} [\d:.]+ +\d+ \S+\] (.*)$")  # torchrun: "failed (exitcode: -9) local_rank: 1 ..."
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:\s?")      # torchrun's prefix on a failed rank's lines
RANK_TAG = re.compile(r"\[rank (\d+)\]")             # megatrain's own log format


class AttemptLog:
    """``on_line`` for ``run_ranks``: ``AttemptLog(run_dir, attempt, forward=logger.info)``."""

    def __init__(self, run_dir: str | Path, attempt: int, forward: Callable[[str], None]):
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.forward = forward
        self.dir = self.run_dir / "logs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"attempt-{attempt}.log"
        self._all = self.path.open("a", buffering=1)
        self._ranks: dict[int, object] = {}
        self._after_warning: set[int] = set()  # sources whose next indented line is a warning's source line
        self._tracebacks: set[int] = set()  # whose traceback is being read: a rank, or -1 (unprefixed lines)
        self._in_torchrun_report = 0  # "=====" lines seen in torchrun's failure report
        self.started = time.time()

    def rank_path(self, rank: int) -> Path:
        return self.dir / f"attempt-{self.attempt}.rank{rank}.log"

    def __call__(self, line: str) -> None:
        line = redact(line.rstrip("\n"))  # a rank that prints a secret: *** in every file and the Prefect log
        self._all.write(line + "\n")
        prefixed = RANK_PREFIX.match(line)
        tagged = prefixed or RANK_TAG.search(line)
        rank = int(tagged.group(1)) if tagged else None
        body = line[prefixed.end():] if prefixed else line
        if rank is not None:
            if rank not in self._ranks:
                self._ranks[rank] = self.rank_path(rank).open("a", buffering=1)
            self._ranks[rank].write(body + "\n")
        shown = self._filter(body, int(prefixed.group(1)) if prefixed else -1)
        if shown is not None:
            self.forward(shown)

    def _filter(self, body: str, source: int) -> str | None:
        """The line the operator sees, or None. ``source``: the rank of a ``[rankN]:`` line, else -1."""
        if self._in_torchrun_report:  # torchrun's "megatrain.train FAILED" block: the cause is in the outcome
            self._in_torchrun_report += body.startswith("=====")
            if self._in_torchrun_report > 2:
                self._in_torchrun_report = 0
            return None
        if body.startswith("Traceback (most recent call last)"):
            self._tracebacks.add(source)
            return None
        if source in self._tracebacks:
            if body[:1] in (" ", "\t", "") or body.startswith("^"):
                return None  # a frame of the traceback
            self._tracebacks.discard(source)  # its last line: the exception
            if "ChildFailedError" in body:  # torchrun's own traceback, then its failure report
                self._in_torchrun_report = 1
                return None
            where = self.rank_path(source) if source >= 0 else self.path
            exception = body.split(":")[0][-80:]
            return f"{'launcher' if source < 0 else f'rank {source}'}: {exception} (traceback in {where})"
        if source in self._after_warning:
            self._after_warning.discard(source)
            if body[:1] in (" ", "\t"):
                return None
        if WARNING.search(body):
            self._after_warning.add(source)
            return None
        if any(p.search(body) for p in NOISE):
            return None
        glog = GLOG_ERROR.match(body)
        return f"torchrun: {glog.group(1)}" if glog else body

    def close(self, outcome: dict) -> None:
        """Record how the attempt ended (status, message, ...) beside the stage's metrics."""
        for handle in [self._all, *self._ranks.values()]:
            handle.close()
        metrics = self.run_dir / "metrics.jsonl"  # where this attempt's rows end (the loss curve marks it)
        rows = len(read_rows(metrics))
        row = {"attempt": self.attempt, "started": self.started, "ended": time.time(), "metrics_rows": rows,
               "log": str(self.path), "rank_logs": {r: str(self.rank_path(r)) for r in sorted(self._ranks)},
               **{k: outcome.get(k) for k in ("status", "message", "wall_s", "returncode", "faulty_ranks", "verdict") if k in outcome}}
        with open_append(self.run_dir / "attempts.jsonl") as handle:
            handle.write(json.dumps(row) + "\n")


def next_attempt(run_dir: str | Path) -> int:
    """The number the stage's next attempt takes: one past every attempt seen in ``run_dir``, by
    its row or its log file (a flow killed mid-attempt leaves no row). A rerun of a stopped
    campaign numbers on, so its attempts get log files of their own instead of appending to
    ``attempt-1.log``."""
    logs = Path(run_dir) / "logs"
    numbers = [int(row["attempt"]) for row in read_attempts(run_dir) if isinstance(row.get("attempt"), int)]
    numbers += [int(m.group(1)) for p in (logs.glob("attempt-*.log") if logs.is_dir() else [])
                if (m := re.fullmatch(r"attempt-(\d+)(?:\.rank\d+)?\.log", p.name))]
    return max(numbers, default=0) + 1


def read_attempts(run_dir: str | Path) -> list[dict]:
    """The attempts of a stage, in order (empty before the first one ends)."""
    return read_rows(Path(run_dir) / "attempts.jsonl")
