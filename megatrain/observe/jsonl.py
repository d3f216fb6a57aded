"""Append-only JSON-lines files (``metrics.jsonl``, ``attempts.jsonl``) that a killed process may
leave with a torn last line.

A rank SIGKILLed (or a disk that fills) in the middle of a write leaves half a row and no newline.
The next attempt appends to the same file, so without care its first row lands on the torn line
and both are lost, and a reader that trusts every line fails the report of a campaign whose
training went fine. So writers open with ``open_append`` (which ends a torn line first) and
readers use ``read_rows`` (which skips, and reports, a line that does not parse).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def open_append(path: str | Path, buffering: int = -1) -> IO[str]:
    """``path`` opened for appending rows, after closing a torn last line with a newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        with path.open("rb") as handle:
            handle.seek(-1, 2)
            torn = handle.read(1) != b"\n"
        if torn:
            with path.open("ab") as handle:
                handle.write(b"\n")
    return path.open("a", buffering=buffering)


def parse_rows(lines: list[str]) -> tuple[list[dict], list[int]]:
    """(the lines that parse as JSON objects, the 1-based numbers of those that do not); blank
    lines are neither."""
    rows, torn = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            torn.append(number)
    return rows, torn


def read_rows(path: str | Path) -> list[dict]:
    """Every row that parses as a JSON object, in file order; a torn or foreign line is skipped
    with a warning naming the file and line (never an exception: these files are reports)."""
    path = Path(path)
    if not path.exists():
        return []
    rows, skipped = parse_rows(path.read_text(errors="replace").splitlines())
    if skipped:
        log.warning("%s: skipped %d line(s) that are not JSON rows (a write cut short?): line %s",
                    path, len(skipped), ", ".join(map(str, skipped[:5])))
    return rows
