"""One thread per connection, started with a bounded wait (the keeper and its peer tier).

``threading.Thread.start`` waits without end for its thread to begin. A thread whose start-up
fails for lack of memory (its stack mapped, its first frame not: "Exception ignored in thread
started by ... MemoryError") never begins, and a keeper at its memory limit hung there with its
socket still in place while every rank's request timed out. ``serve_in_thread`` waits a bounded
time instead and raises, so the keeper ends with the cause in its log.
"""

from __future__ import annotations

import _thread
import socket
import threading
from collections.abc import Callable

THREAD_START_S = 10.0  # a connection's thread that has not begun this long after its start never will


def serve_in_thread(serve: Callable[..., None], conn: socket.socket, *args: object) -> None:
    """Run ``serve(conn, *args)`` in a new thread; RuntimeError ("can't start new thread") if it
    cannot start or does not begin within THREAD_START_S (``conn`` is closed then)."""
    began = threading.Event()

    def run() -> None:
        began.set()
        serve(conn, *args)

    try:
        _thread.start_new_thread(run, ())  # raises RuntimeError "can't start new thread" itself
    except RuntimeError:
        conn.close()
        raise
    if not began.wait(THREAD_START_S):
        conn.close()
        raise RuntimeError(f"can't start new thread: the thread serving a connection did not begin within "
                           f"{THREAD_START_S:g} s (the process's memory is full?)")
