"""Log records kept in memory with their times: what a harness reads back from a run it drives
in-process (the flow runs in the same process; rank output arrives as task-run records). Used by
the fault-matrix tests and ``benchmarks/chaos_ettr.py`` to time faults, verdicts and restarts."""

from __future__ import annotations

import logging
import re


class TimedLogRecords(logging.Handler):
    """Every record this handler sees, as (``record.created``, message)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.created, record.getMessage()))
        except Exception:  # a record that cannot format is not ours to fail on
            pass

    def find_all(self, pattern: str) -> list[tuple[float, re.Match]]:
        """(time, match) of every record matching ``pattern``, in order."""
        regex = re.compile(pattern)
        return [(t, m) for t, msg in list(self.records) if (m := regex.search(msg))]

    def find(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        """The first record at or after ``after`` matching ``pattern``: (time, message)."""
        regex = re.compile(pattern)
        return next(((t, m) for t, m in list(self.records) if t >= after and regex.search(m)), None)
