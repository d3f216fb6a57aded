"""A keeper that runs out of memory is reported by its own cause of death, from its log, not as a
socket that is not there (issue 48)."""

from __future__ import annotations

import resource
import socket
import time

import pytest

from megatrain.checkpoint.keeper import SOCKET
from megatrain.checkpoint.keeper_control import KeeperError, ask, start_keeper


def test_a_keeper_that_ran_out_of_memory_is_reported_by_its_own_cause(tmp_path):
    folder, log = tmp_path / "keeper", tmp_path / "logs" / "keeper.log"
    proc = start_keeper(folder, log)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it answers (this process then knows where it writes)
            try:
                pid = int(ask(folder, "list")[0]["pid"])
                break
            except KeeperError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.05)
        # its memory is full: it may hold what it has, not one byte more (a thread's stack included)
        used = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmData"))
        resource.prlimit(pid, resource.RLIMIT_DATA, (used * 1024, used * 1024))
        # connections held open at once: each needs a thread, whose stack the memory no longer has
        # room for (one connection at a time may reuse the stack of the thread before it)
        held, deadline = [], time.monotonic() + 60
        while proc.poll() is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(str(folder / SOCKET))
            except OSError:
                conn.close()
            else:
                held.append(conn)
            assert time.monotonic() < deadline, f"the keeper still runs at its memory limit: {log.read_text()}"
            time.sleep(0.1)
        for conn in held:
            conn.close()
        assert proc.wait(timeout=30) != 0
        with pytest.raises(KeeperError) as gone:
            ask(folder, "list")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    message = str(gone.value)
    assert "No such file" not in message, message
    assert message.startswith(f"the checkpoint keeper at {folder} died: ") and f"(its log: {log})" in message
    assert "can't start new thread" in message or "MemoryError" in message, message
