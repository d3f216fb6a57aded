"""Which failures a task retries: only those a retry can fix. A ``DeterministicError`` (a full
disk, a name that leaves its folder, a mismatching checkpoint, bad input) fails at once with its
cause; retrying it would only repeat it after the backoff."""

from __future__ import annotations


def unless_deterministic(task, task_run, state) -> bool:
    """``retry_condition_fn`` for tasks whose other failures (I/O, a storage outage, a crash) are
    worth retrying."""
    from megatrain.errors import DeterministicError

    try:
        state.result()
    except DeterministicError:
        return False
    except BaseException:
        return True
    return True
