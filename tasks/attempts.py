"""One attempt of a stage, as both launch tasks see it (``launch-ranks`` in ``train.py`` and
``launch-nodes`` in ``elastic.py``): whether to stop its ranks, and its task-run state from how it
ended."""

from __future__ import annotations

import threading
from dataclasses import asdict

from prefect.states import Cancelled, Failed

from tasks._log import run_logger
from tasks.stop import STOP

# config path of a running stage -> set when the stage gives up on it (an upload failed for
# good, or the task raised), so its launch thread stops the ranks instead of training on alone
ABANDONED: dict[str, threading.Event] = {}


def abandoned_event(config_path: str) -> threading.Event:
    """Set when the stage gives up on its attempt (an upload failed for good); taken when the
    launch starts, since the stage forgets it once it has ended."""
    return ABANDONED.get(config_path) or threading.Event()


def should_stop(abandoned: threading.Event):
    """What a launch polls to stop its ranks: a stop of the flow (signal, cancel) or the stage
    giving up on this attempt."""
    return lambda: STOP.is_set() or abandoned.is_set()


def attempt_state(result, attempt: int, attempt_log, abandoned: threading.Event, extra: dict | None = None):
    """An attempt's task-run state from the engine's ``LaunchResult``: the outcome dict when it
    completed, Cancelled when it was stopped, Failed (red, with the cause) otherwise; the stage
    reads the outcome from any of them. ``extra``: fields added to the outcome (e.g. the nodes)."""
    stopped_by = STOP.reason if STOP.is_set() else "the stage failed" if abandoned.is_set() else None
    if stopped_by and not result.ok:
        result.status, result.message = "stopped", f"stopped ({stopped_by})"
    attempt_log.close(asdict(result))
    logger = run_logger()
    level = logger.info if result.ok else logger.warning if result.status == "stopped" else logger.error
    if result.message.startswith(result.status):  # "stopped (SIGINT)": said once, not twice
        level("attempt %d ended: %s after %.1f s", attempt, result.message, result.wall_s)
    else:
        level("attempt %d ended: %s after %.1f s. %s", attempt, result.status, result.wall_s, result.message)
    outcome = asdict(result)  # one line for the states and the report; stacks stay in the log above
    outcome["message"] = result.message.strip().splitlines()[0] if result.message.strip() else ""
    outcome.update(extra or {})
    if result.status == "stopped":
        return Cancelled(message=result.message, data=outcome)
    if not result.ok:  # a red task run with the cause; the stage reads the outcome and recovers
        return Failed(message=f"attempt {attempt} {result.status}: {result.message}", data=outcome)
    return outcome
