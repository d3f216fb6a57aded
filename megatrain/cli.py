"""The ``megatrain`` command. Each subcommand lives with its module and is imported only when
used, so ``megatrain --help`` stays fast and the engine's heavy imports happen on demand.

One error path for people. Every subcommand runs inside one handler (``run_command``; the
campaign flow's command line, ``python -m flows.pretrain``, uses it too). A failure a person can
act on ends as ONE line on stderr, ``megatrain <command>: <message>`` (the message names the file,
URL or field; its newlines folded into `` | ``), and an exit code that says what kind it was:

====  =========================================================================================
code  meaning (the errors that end in it)
====  =========================================================================================
0     done
1     bad input: a data source, tokenizer, shard, checkpoint or path that is missing, unreadable
      or corrupt (``InputError``, ``DataError``, ``ChecksumError``, ``CheckpointError``, an
      ``OSError`` naming a path: not found, a directory where a file belongs or the reverse,
      already there, no permission, read-only)
2     bad config or arguments (``ConfigError``; argparse's usage errors, its usage line and all)
3     a training anomaly (NaN, loss spike) that a rollback may fix (``train``)
4     deterministic: fails alike on every retry (any other ``DeterministicError``: a checkpoint
      of another model, no space (also ENOSPC on a named path), a location not writable;
      ``train`` also ends an input error met while training with 4, the code its launcher knows)
5     out of host memory (``MemoryError``, torch's CPU allocator failing): the line says where
70    internal error, a bug: the line names the exception and the file holding its traceback,
      ``<tempdir>/megatrain-errors/<command>-<time>-<pid>.log`` (``$TMPDIR``, else ``/tmp``)
75    temporary: a storage outage, an upload that gave up (``StorageError``, ``UploadError``):
      the same command may succeed later (a ``StorageError`` of a URL that is not there, or
      not permitted, is bad input: 1)
130   interrupted (Ctrl-C)
====  =========================================================================================

``python -m flows.pretrain`` ends by the same table (``campaign_exit``): a stage whose ranks failed
deterministically 4, as ``megatrain train`` would; 1 also for a campaign that ran and gave up
(restarts or rollbacks used up), 2 also for a campaign whose inputs are missing (nothing started),
143 stopped by SIGTERM. Its last line offers the command that resumes only where running it again
can get past the failure (interrupted, temporary, restarts used up); otherwise it says that the
cause named on the line must change first.

A subcommand that says its own failure in one line and returns a code keeps doing so.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from megatrain.errors import (
    EXIT_BUG,
    EXIT_CONFIG,
    EXIT_DETERMINISTIC,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NO_MEMORY,
    EXIT_TEMPORARY,
    one_line,
)

# name -> ("module:function", help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatrain.training.rank:main", "train a model from a recipe (one process; torchrun for more)"),
    "eval": ("megatrain.evaluate.heldout:cli", "validation loss of a committed checkpoint (any layout) on held-out data"),
    "export": ("megatrain.interop.hf:cli", "write a committed checkpoint as a Hugging Face transformers folder"),
    "import": ("megatrain.interop.hf:import_cli", "write a recipe that starts from a local transformers checkpoint"),
    "generate": ("megatrain.evaluate.generate:cli", "sample text from a committed checkpoint (KV cache, greedy/top-k/top-p)"),
    "shard": ("megatrain.data.shard:cli", "tokenize a corpus into webdataset shards with an index"),
    "selfcheck": ("megatrain.reliability.selfcheck:cli", "GEMM, memory, all-reduce, storage and Redis checks"),
    "checkpoints": ("megatrain.checkpoint.cli:cli", "list, verify or inspect committed checkpoints"),
    "plan": ("megatrain.parallel.plan:cli", "print the per-GPU memory plan of a recipe"),
    "report": ("megatrain.report.cli:cli", "a campaign's report (a campaign dir), or summaries of run dirs"),
    "cluster": ("megatrain.launch.cluster_services:cli", "hosts on this machine as namespaces on a bridge: up, down, list, exec"),
    "status": ("megatrain.report.status:cli", "where a campaign stands: stages, steps, loss, faults, checkpoints"),
}

# The failures a person can act on, as "module:Class" -> exit code. The first row the error is an
# instance of wins, so narrower classes come first. A class is looked up in sys.modules only (an
# error of a module never imported cannot have been raised): the handler imports nothing heavy.
KNOWN_FAILURES: list[tuple[str, int]] = [
    ("megatrain.config.load:ConfigError", EXIT_CONFIG),
    ("megatrain.config.schema:BatchSplitError", EXIT_CONFIG),  # a batch that does not split: train.* fields
    ("megatrain.errors:CheckpointMismatch", EXIT_DETERMINISTIC),  # before CheckpointError, which it also is
    ("megatrain.errors:InputError", EXIT_INPUT),
    ("megatrain.data.index:DataError", EXIT_INPUT),
    ("megatrain.checkpoint.files:ChecksumError", EXIT_INPUT),  # and UnreadableFile: a corrupt checkpoint file
    ("megatrain.checkpoint.restore:CheckpointError", EXIT_INPUT),
    ("megatrain.storage.urls:StorageError", EXIT_TEMPORARY),
    ("megatrain.checkpoint.upload:UploadError", EXIT_TEMPORARY),
    ("megatrain.errors:MegatrainError", EXIT_DETERMINISTIC),  # DeterministicError, NoSpaceError, UnsafePathError...
]

# An OSError naming its file, for these causes, is about a path the person gave: missing, a
# directory where a file belongs (or the reverse), in the way, not permitted; or a full disk.
PATH_ERRNOS: dict[int, int] = {
    errno.ENOENT: EXIT_INPUT, errno.EISDIR: EXIT_INPUT, errno.ENOTDIR: EXIT_INPUT, errno.EEXIST: EXIT_INPUT,
    errno.EACCES: EXIT_INPUT, errno.EPERM: EXIT_INPUT, errno.EROFS: EXIT_INPUT,
    errno.ENOSPC: EXIT_DETERMINISTIC, errno.EDQUOT: EXIT_DETERMINISTIC,
}

# A storage error caused by one of these is about the URL given, not an outage.
PATH_PROBLEMS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError)

MAX_DETAIL = 500  # characters of a bug's message on its line (the file has all of it)
PROJECT = Path(__file__).resolve().parents[1]
OUR_CODE = tuple(PROJECT / package for package in ("megatrain", "flows", "tasks"))


def usage() -> str:
    lines = ["usage: megatrain COMMAND [ARGS...]   (megatrain --version)", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "A failure is one line on stderr. Exit codes: 1 bad input, 2 bad config or arguments, 3 anomaly,",
              "4 deterministic, 5 out of host memory, 70 internal error (traceback in a file), 75 temporary, 130 interrupted."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from megatrain import __version__

        print(f"megatrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatrain: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_CONFIG
    module_name, function_name = COMMANDS[name][0].split(":")

    def command(args: list[str]) -> int:  # the import too: a module that fails to import is a bug to report
        return getattr(importlib.import_module(module_name), function_name)(args)

    return run_command(f"megatrain {name}", command, rest)


def run_command(command: str, function: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """``function(argv)``'s exit code; a failure it raises ends as one line on stderr starting with
    ``command`` and the exit code of its kind (the module docstring). argparse's exits pass."""
    try:
        return function(argv) or 0
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 (any failure: one line, a bug's traceback to a file)
        return report_failure(command, exc, argv)


def report_failure(command: str, exc: BaseException, argv: list[str]) -> int:
    """Say ``exc`` in one line on stderr and return its exit code; a bug's traceback goes to a file."""
    known = classify(exc)
    if known is not None:
        code, message = known
    else:
        code, where = EXIT_BUG, write_traceback(command, exc, argv)
        detail = one_line(str(exc)) or "(no message)"
        detail = detail if len(detail) <= MAX_DETAIL else detail[:MAX_DETAIL] + "..."
        if where is None:  # no file could take it: the traceback itself, then the line
            traceback.print_exception(exc, file=sys.stderr)
            message = f"internal error {type(exc).__name__}: {detail} (traceback above)"
        else:
            message = f"internal error {type(exc).__name__}: {detail} (traceback in {where})"
    sys.stdout.flush()
    print(f"{command}: {message}", file=sys.stderr, flush=True)
    return code


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) of a failure a person can act on; None for a bug."""
    from megatrain.storage.space import is_no_space  # a failure only: the command's own imports stay light
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, one_line(str(exc)) or "interrupted"
    if out_of_memory(exc):
        detail = one_line(str(exc)).partition("DefaultCPUAllocator: ")[2] or one_line(str(exc))
        return EXIT_NO_MEMORY, f"out of host memory while {doing(exc)}" + (f": {detail}" if detail else "")
    for name, code in KNOWN_FAILURES:
        module_name, _, class_name = name.partition(":")
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(exc, cls):
            if code == EXIT_TEMPORARY and isinstance(exc.__cause__, PATH_PROBLEMS):  # no outage: a bad path
                code = EXIT_INPUT
            if code == EXIT_TEMPORARY and is_no_space(exc):  # no outage either: the same write fills it again
                code = EXIT_DETERMINISTIC
            return code, one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in PATH_ERRNOS:
        reason = exc.strerror or os.strerror(exc.errno)
        return PATH_ERRNOS[exc.errno], f"{exc.filename}: {reason[:1].lower()}{reason[1:]}"
    if is_no_space(exc):  # a buffered write fills the disk at its close: the OS names no file then
        return EXIT_DETERMINISTIC, f"no space left on device (or quota) while {doing(exc)}"
    return None


def campaign_exit(failure: BaseException | None, cancelled_by: str | None = None) -> tuple[int, bool]:
    """How a campaign run that did not complete ends: (exit code, whether rerunning the same
    command can get past it). ``failure``: what the flow's Failed state holds (a stage's error),
    ``cancelled_by``: the signal that stopped it (SIGINT, SIGTERM) or "cancelled"."""
    import signal

    if cancelled_by is not None:
        return {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}.get(cancelled_by, EXIT_INTERRUPTED), True
    known = classify(failure) if isinstance(failure, BaseException) else None
    if known is None:  # a stage that gave up on faults a later run may not meet (restarts used up), a lease held
        return EXIT_INPUT, True
    code = known[0]
    return code, code in (EXIT_TEMPORARY, EXIT_INTERRUPTED)


def out_of_memory(exc: BaseException) -> bool:
    """A MemoryError, or what torch's CPU allocator and the dynamic loader raise instead."""
    text = str(exc)
    return (isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in text)
            or (isinstance(exc, ImportError) and "failed to map segment" in text))


def doing(exc: BaseException) -> str:
    """What the command was doing when ``exc`` rose: its innermost frame in the project's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if os.path.isabs(f.filename)
            and any(Path(f.filename).resolve().is_relative_to(folder) for folder in OUR_CODE)]
    where = f"in {ours[-1].name} ({Path(ours[-1].filename).resolve().relative_to(PROJECT)}:{ours[-1].lineno})" if ours else "starting"
    importing = isinstance(exc, ImportError) or (frames and "importlib" in frames[-1].filename)
    return f"importing modules, {where}" if importing else where


def write_traceback(command: str, exc: BaseException, argv: list[str]) -> Path | None:
    """Write ``exc``'s traceback (after the command line) to a new file and return its path; None
    when no file could be written."""
    stem = re.sub(r"\W+", "-", command.removeprefix("python -m "))
    try:
        folder = Path(tempfile.gettempdir()) / "megatrain-errors"
        path = folder / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{' '.join([command, shlex.join(argv)]).rstrip()}\n{time.strftime('%Y-%m-%d %H:%M:%S %z')}, "
                        f"pid {os.getpid()}, python {sys.version.split()[0]}\n\n" + "".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


if __name__ == "__main__":
    sys.exit(main())
