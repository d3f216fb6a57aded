"""Stop means stop: SIGTERM, SIGINT and a cancel from the UI or CLI all end in one stop request,
which the launch task turns into stopping the ranks (``run_ranks(should_stop=...)``), after which
the stage commits what is already staged and ends Cancelled.

Why process-wide: a signal is delivered to the process, and a cancel is a state of the flow run
the whole process serves; every stage and launch thread of this process must see it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


class StopRequest:
    """Set once, with the reason (the first one wins); cleared when a flow run starts."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self._checked_at = 0.0

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason  # no logging here: this runs inside signal handlers
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event.clear()
        self.reason = ""

    def check_cancelled(self, every_s: float = 2.0) -> bool:
        """Read this flow run's state (at most every ``every_s``): Cancelling or Cancelled (the
        UI's Cancel, ``prefect flow-run cancel``) requests a stop. Returns ``is_set()``."""
        now = time.monotonic()
        if not self.is_set() and now - self._checked_at >= every_s:
            self._checked_at = now
            state = _flow_run_state()
            if state is not None and (state.is_cancelling() or state.is_cancelled()):
                self.request(f"flow run {state.name.lower()} from the UI or CLI")
        return self.is_set()


STOP = StopRequest()


def _flow_run_state():
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if run_id is None:
        return None
    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id).state
    except Exception:  # the API is briefly unreachable: ask again next time
        return None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """While the flow runs: the first SIGTERM or SIGINT requests a stop (the ranks are stopped and
    what is staged is committed); a second one of the same kind goes to the previous handler
    (Prefect's crash for SIGTERM, KeyboardInterrupt for SIGINT). Only the main thread can set
    handlers; elsewhere (a flow run in a worker thread) this only clears the request."""
    STOP.clear()
    previous: dict[int, object] = {}

    def handler(signum, frame) -> None:
        if STOP.is_set() and STOP.reason == signal.Signals(signum).name:
            old = previous.get(signum)
            if callable(old):
                old(signum, frame)
            raise KeyboardInterrupt
        STOP.request(signal.Signals(signum).name)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, handler)
    try:
        yield STOP
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
