"""Waits on another process: each has a deadline, says what it waits for, and shows in the heartbeat.

A process we do not control can stop answering without dying (SIGSTOP, a stalled machine, a
peer that accepted a connection and never replies), and a wait on it without a bound is a hang
no watchdog sees. So every such wait - a checkpoint keeper, a peer keeper, the rendezvous
store, the Dask scheduler, the durable store, the Prefect API, a lease's holder - is written as

    with waiting("checkpoint keeper: list", where=socket_path, pid=pid, deadline_s=5.0) as wait:
        reply = call(timeout=wait.remaining())

While it lasts the wait is registered for this process, and a rank's heartbeat writer publishes
the waits with every record (``HeartbeatRecord.waits``): the watcher names what a rank waits for,
and calls it hung once a wait is past its deadline by more than a grace (the call's own bound
failed). A wait that runs out raises ``WaitTimeout``: one line naming what was waited for and
where (socket, address, pid), which the caller turns into its next tier or its retry policy.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_current: dict[int, Wait] = {}
_ids = itertools.count()


class WaitTimeout(TimeoutError):
    """A wait on another process ran past its deadline (the message names what, where and how long)."""


@dataclass
class Wait:
    what: str  # e.g. "checkpoint keeper: list"
    where: str  # a socket path, host:port or URL
    deadline_s: float
    pid: int | None = None
    since: float = field(default_factory=time.time)  # wall clock: the watcher reads it on another host
    _start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def remaining(self, floor_s: float = 0.001) -> float:
        """Seconds left to the deadline (at least ``floor_s``: a timeout of 0 means "block" to some APIs)."""
        return max(floor_s, self.deadline_s - self.elapsed())

    def expired(self) -> bool:
        return self.elapsed() >= self.deadline_s

    def describe(self) -> str:
        return f"{self.what} at {self.where}" + (f" (pid {self.pid})" if self.pid is not None else "")

    def timeout(self, detail: str = "") -> WaitTimeout:
        """The one-line error of this wait run out (``detail``: what the caller knows more, e.g. a process state)."""
        return WaitTimeout(f"no answer from {self.describe()} within {self.deadline_s:g} s"
                           + (f" ({detail})" if detail else ""))

    def record(self) -> dict[str, Any]:
        return {"what": self.what, "where": self.where, "pid": self.pid, "since": self.since,
                "deadline_s": self.deadline_s}


@contextlib.contextmanager
def waiting(what: str, where: str, deadline_s: float, pid: int | None = None) -> Iterator[Wait]:
    """Register a wait on another process for as long as the block runs (see the module doc)."""
    wait, key = Wait(what, where, deadline_s, pid), next(_ids)
    with _lock:
        _current[key] = wait
    try:
        yield wait
    finally:
        with _lock:
            _current.pop(key, None)


def current() -> list[dict[str, Any]]:
    """This process's waits on other processes now (for the heartbeat), oldest first."""
    with _lock:
        return [wait.record() for wait in _current.values()]


def bounded(call: Callable[[], T], wait: Wait, detail: str = "") -> T:
    """``call()``'s result (or its exception), or ``wait.timeout(detail)`` once the wait's deadline
    passes: for a library call whose own timeout does not hold (c10d's TCPStore client blocks
    past it against a server that accepted and stopped answering). The call runs in a daemon
    thread, left behind on a timeout: the caller's error ends the process or drops the client.
    The call must release the GIL while it blocks (c10d's do)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001  (raised again in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"bounded: {wait.what}", daemon=True)
    thread.start()
    thread.join(wait.remaining())
    if thread.is_alive():
        raise wait.timeout(detail)
    if "error" in box:
        raise box["error"]
    return box["value"]
