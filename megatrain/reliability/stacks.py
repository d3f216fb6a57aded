"""Python stacks of live ranks, for finding out where a hung rank is stuck.

Each rank calls ``install_stack_dump``: SIGUSR1 then makes ``faulthandler`` append the stacks
of all its threads to ``<run_dir>/stacks/rank<k>.txt``. faulthandler writes from the C signal
handler without taking the GIL, so this works even while the main thread sits inside a C++
collective - exactly when it is needed. A watcher on the same host calls ``collect_stacks``:
signal, wait for the file to stop growing, read what was appended. Processes that registered
no handler are dumped with ``py-spy`` when it is installed.

A watcher cannot signal a process on another host: it asks through the heartbeat store instead
(``RedisSink.request_stacks``), and each rank's heartbeat thread answers with ``own_stacks`` (that
thread runs while the main thread waits in a collective; a frozen process answers nothing).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

STACK_SIGNAL = signal.SIGUSR1


def stack_file(stacks_dir: str | Path, rank: int) -> Path:
    return Path(stacks_dir) / f"rank{rank}.txt"


def install_stack_dump(path: str | Path) -> IO[str]:
    """Make SIGUSR1 append this process's Python stacks (all threads) to ``path``.

    Returns the open file: the caller keeps it open for as long as the handler is registered.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a")  # noqa: SIM115 - must outlive this function
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    return handle


def own_stacks() -> str:
    """This process's Python stacks, every thread's, as faulthandler writes them."""
    with tempfile.TemporaryFile("w+") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
        handle.seek(0)
        return handle.read()


def collect_stacks(
    pids: Mapping[int, int], stacks_dir: str | Path | None = None, timeout_s: float = 3.0
) -> dict[int, str]:
    """Python stacks of local processes, by rank: SIGUSR1 + the rank's faulthandler file when
    it registered one (see ``install_stack_dump``), else ``py-spy dump`` if installed."""
    stacks: dict[int, str] = {}
    pending: dict[int, tuple[Path, int]] = {}
    for rank, pid in pids.items():
        path = stack_file(stacks_dir, rank) if stacks_dir is not None else None
        if path is not None and path.exists():
            offset = path.stat().st_size
            try:
                os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                stacks[rank] = f"(pid {pid} is gone)"
                continue
            pending[rank] = (path, offset)
        elif shutil.which("py-spy"):
            stacks[rank] = _py_spy_dump(pid, timeout_s)
        else:
            stacks[rank] = "(no stack file and no py-spy: cannot collect)"
    stacks.update(_read_new_text(pending, timeout_s))
    return stacks


def ask_stacks(sink, records: Mapping, timeout_s: float = 5.0) -> dict[int, str]:
    """Stacks of ranks on other hosts (rank -> its ``HeartbeatRecord``), asked for through the store
    (``RedisSink.request_stacks``; the ranks' heartbeat threads answer with ``own_stacks``). A rank
    that does not answer in ``timeout_s`` (frozen, cut off) says so; an answer counts only from the
    process (host, pid) of the rank's record."""
    if not records:
        return {}
    if not hasattr(sink, "request_stacks"):
        return {rank: f"(rank runs on {r.host}; collect its stack there)" for rank, r in records.items()}
    try:
        request = sink.request_stacks()
        deadline, replies = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            replies = sink.read_stacks(request)
            if all((rank, r.host, r.pid) in replies for rank, r in records.items()):
                break
            time.sleep(0.1)
    except Exception as exc:  # the store is down: no remote stacks this time
        return {rank: f"(rank runs on {r.host}; the store did not answer: {exc})" for rank, r in records.items()}
    return {rank: replies.get((rank, r.host, r.pid),
                              f"(rank runs on {r.host}, pid {r.pid}: no answer to the stack request in "
                              f"{timeout_s:.0f} s: frozen or cut off)")
            for rank, r in records.items()}


def _read_new_text(pending: dict[int, tuple[Path, int]], timeout_s: float) -> dict[int, str]:
    """Wait until each file has grown and then stopped growing (the dump is complete)."""
    deadline = time.monotonic() + timeout_s
    sizes = {rank: -1 for rank in pending}
    out: dict[int, str] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank, (path, offset) in list(pending.items()):
            size = path.stat().st_size
            if size > offset and size == sizes[rank]:
                with open(path) as handle:
                    handle.seek(offset)
                    out[rank] = handle.read()
                del pending[rank]
            sizes[rank] = size
    for rank in pending:
        out[rank] = f"(no stack written within {timeout_s:.0f} s)"
    return out


def _py_spy_dump(pid: int, timeout_s: float) -> str:
    try:
        done = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"(py-spy dump of pid {pid} timed out)"
    return done.stdout or done.stderr
