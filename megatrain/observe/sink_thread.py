"""The tracking sinks off the training thread: a step hands its scalars over in a queue put.

TensorBoard's event is cheap (0.07 ms, ``tensorboard.py``), but MLflow's ``log_metrics`` is an HTTP
round trip to its server and W&B's ``log`` can wait on its own queue: on the training thread every
step would pay them, and a tracking server that stalls would stall training (the watcher would
then call a healthy rank hung). One thread per run writes to every sink in step order.

A sink that fails does not fail silently: its error is raised on the training thread at the next
``write`` (or at ``close``), naming the sink, and the rows after it are not written to that sink.
The queue is bounded: a sink that falls far behind slows the loop down rather than growing memory
without end (``max_pending`` steps, 10,000 by default: hours of steps at typical step times).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger("megatrain")

_CLOSE = object()


class SinkError(RuntimeError):
    """A tracking sink failed in the background thread."""


class BackgroundSinks:
    """``write`` / ``close`` like a sink, for several sinks written by one background thread."""

    def __init__(self, sinks: list[Any], max_pending: int = 10_000):
        self.sinks = list(sinks)
        self._rows: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._failed_sink = ""
        self._thread = threading.Thread(target=self._drain, name="metrics-sinks", daemon=True)
        self._thread.start()

    def write(self, step: int, values: dict[str, float]) -> None:
        self._raise_if_failed()
        self._rows.put((step, dict(values)))  # a copy: the caller may reuse its dict

    def close(self, timeout_s: float = 60.0) -> None:
        """Writes what is queued, closes every sink, then raises a sink's error if one failed. A
        sink still stuck after ``timeout_s`` (a tracking server that stopped answering) is left
        behind with a warning naming the rows it did not get: metrics.jsonl already holds every
        row, and the run's end must not wait on a dashboard."""
        deadline = time.monotonic() + timeout_s
        try:
            self._rows.put(_CLOSE, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("metrics sinks %s still writing after %.0f s: about %d rows not written to them "
                        "(metrics.jsonl has every row)", [type(sink).__name__ for sink in self.sinks], timeout_s,
                        self._rows.qsize())
            return
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - every sink gets closed; the first error is raised
                self._record(sink, exc)
        self._raise_if_failed()

    def _drain(self) -> None:
        while True:
            row = self._rows.get()
            if row is _CLOSE:
                return
            step, values = row
            for sink in list(self.sinks):
                try:
                    sink.write(step, values)
                except Exception as exc:  # noqa: BLE001 - raised on the training thread, see _raise_if_failed
                    self._record(sink, exc)
                    self.sinks.remove(sink)  # its later rows would fail the same way

    def _record(self, sink: Any, exc: BaseException) -> None:
        if self._error is None:
            self._error, self._failed_sink = exc, type(sink).__name__

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise SinkError(f"metrics sink {self._failed_sink}: {type(error).__name__}: {error}") from error
