"""Small file helpers shared by the reliability modules.

Readers of these files (a watcher, the orchestrator) run in other processes and may read at any
moment, so every write goes to a temporary file in the same directory and is renamed into place:
``os.replace`` is atomic on POSIX, so a reader sees the old content or the new, never half.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that concurrent readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
