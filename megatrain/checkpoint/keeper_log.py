"""Why a checkpoint keeper is gone, from its own log: the cause a person is told.

A keeper that dies (out of memory: a ``MemoryError``, or "can't start new thread" when its
address space is full) removes its socket on the way out, so the next connection only learns
"No such file or directory": true, and no help. Its own last words are in the log it wrote
(``<run dir>/logs/keeper.log``): the traceback it ended with. ``KeeperClient.connect`` names that
cause instead when it can find it: in the log of a keeper this process started, or in the log the
keeper of that folder was writing when this process last reached it (its stdout, read from
/proc when it answered).

Imports neither torch nor prefect.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from pathlib import Path

_LOGS: dict[str, Path] = {}  # keeper folder -> the log its keeper wrote when it last answered here
# a traceback's last line: "MemoryError", "RuntimeError: can't start new thread", "pkg.mod.Error: ..."
_EXCEPTION = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt|Exit)(?::\s.*)?$")
TAIL_BYTES = 64 * 1024  # a death is at the end of the log: read no more of a long-lived one


def note_log(folder: Path, sock: socket.socket) -> None:
    """Remember the log of the keeper at the other end of ``sock`` (its stdout, by /proc)."""
    try:
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        target = os.readlink(f"/proc/{pid}/fd/1")
    except (OSError, struct.error):
        return
    if target.startswith("/") and os.path.isfile(target):
        _LOGS[str(folder)] = Path(target)


def death_cause(folder: Path, log_path: Path | None = None) -> tuple[str, Path] | None:
    """(the exception that ended the keeper of ``folder``, its log) where its log shows one after
    its last start there; None where it exited cleanly, or no log is known."""
    log_path = log_path or _LOGS.get(str(folder))
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, os.path.getsize(log_path) - TAIL_BYTES))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    started = max((i for i, line in enumerate(lines) if f"serving {folder}" in line), default=-1)
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not tracebacks or tracebacks[-1] < started:
        return None
    found = [line.strip() for line in lines[tracebacks[-1] + 1:] if _EXCEPTION.match(line.strip())]
    return (found[-1], log_path) if found else None


def gone_message(folder: Path, socket_path: Path, exc: OSError, log_path: Path | None = None) -> str:
    """The line for a keeper that does not answer: its own cause of death where its log has one."""
    cause = death_cause(folder, log_path)
    if cause is not None:
        return f"the checkpoint keeper at {folder} died: {cause[0]} (its log: {cause[1]})"
    return f"no checkpoint keeper answers at {socket_path}: {exc}"
