"""Helpers shared by the heartbeat and watcher tests (a module of its own: test files import it
by name, which would be ambiguous for ``conftest``, of which the test tree has several)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from megatrain.reliability.heartbeat import DirectorySink, HeartbeatSink, RedisSink

T = TypeVar("T")


def make(kind: str, tmp_path: Path, redis_url: str, run_id: str) -> HeartbeatSink:
    """The sink a parametrized test names: ``"redis"`` (the session's server) or a directory."""
    return RedisSink(redis_url, run_id) if kind == "redis" else DirectorySink(tmp_path / "hb")


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, poll_s: float = 0.02) -> T:
    """The predicate's first truthy value; fails the test after ``timeout_s`` (the writers publish
    from their own threads, so what they sent shows up a little later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError("condition not met in time")
