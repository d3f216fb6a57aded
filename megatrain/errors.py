"""What kind of failure a run can end in, so the orchestrator knows whether a retry can help.

A *deterministic* error fails the same way on every attempt: a bad config, a checkpoint written
by a different model, a missing data source or tokenizer, a bad shard under ``on_bad_shard:
error``. Retrying it only burns restarts and hides its cause, so the rank prints one line
``megatrain: deterministic error: <Class>: <message>`` and exits with ``EXIT_DETERMINISTIC``; the
launcher ends the stage at once with that message. Everything else (a crash, a hang, an anomaly)
is transient and may be retried.

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

# Exit codes of a rank (torchrun passes the first failing rank's code through).
EXIT_OK = 0
EXIT_CONFIG = 2  # the config did not validate (before any process group exists)
EXIT_ANOMALY = 3  # NaN / loss spike: the flow rolls back
EXIT_DETERMINISTIC = 4  # see DeterministicError: no restart can help

# Further exit codes of the ``megatrain`` command (``megatrain/cli.py`` maps errors to them).
EXIT_INPUT = 1  # bad input: a data source, tokenizer, shard, checkpoint or path missing or corrupt
EXIT_NO_MEMORY = 5  # out of host memory
EXIT_BUG = 70  # an unexpected exception (sysexits' EX_SOFTWARE): its traceback went to a file
EXIT_TEMPORARY = 75  # a storage outage, an upload that gave up (EX_TEMPFAIL): a retry may help
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

# The line a rank prints before exiting with EXIT_DETERMINISTIC; the launcher looks for it.
DETERMINISTIC_PREFIX = "megatrain: deterministic error: "


class MegatrainError(Exception):
    """Base of megatrain's own errors."""


class DeterministicError(MegatrainError):
    """Fails identically on every retry; the stage ends at once with this message."""


class RanksRefused(DeterministicError):
    """A stage whose ranks ended with a deterministic error (the message is theirs): the flow
    ends with EXIT_DETERMINISTIC, as ``megatrain train`` would, and rerunning the same command
    would fail the same way, so no "Resume:" command is offered."""


class CheckpointMismatch(DeterministicError):
    """A checkpoint that cannot be restored into this run (model-changing fields differ)."""


class InputError(DeterministicError):
    """A data source, tokenizer, shard or other input that is missing or invalid."""


class UnsafePathError(DeterministicError, ValueError):
    """A name read from metadata that would leave its folder (``..``, absolute, symlink out)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C of a run, with what a person needs to go on: the last committed step and the
    command that resumes (``megatrain/cli.py`` prints it as the one line)."""


def one_line(text: str) -> str:
    """A message folded onto one line: its non-blank lines, stripped, joined by `` | ``."""
    return " | ".join(line.strip() for line in str(text).splitlines() if line.strip())
