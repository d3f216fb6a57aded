"""The process table, read the way the stop and kill tests check it (no psutil)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def processes_mentioning(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (torchrun and its ranks carry the stage's
    config path)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found
