"""Forked ranks: a CPU node's ranks forked from one warm process, not each importing torch.

A rank process spends its first seconds importing torch, DeepSpeed and the trainer (2-4 s of CPU
each on this project's 2-core machines), and torchrun's agent imports torch once more before it
starts them: a 2-rank attempt paid three imports. Here the launcher keeps one fork server
(Python's ``multiprocessing`` forkserver) that imports all of that once, for the launcher's
lifetime, and forks each rank of every attempt from it: an attempt then starts in a fraction of
a second, restarts after a fault included.

Each forked rank is what ``python -m megatrain.train ARGV`` would be, started as torchrun would
start it: its own session (one ``killpg`` stops it and its children), the environment torchrun
sets (``rank_env``) on top of the launch's, its output to the launcher line by line, and killed
by the kernel when the fork server goes, which goes when the launcher does (the server exits at
EOF of its pipe to the launcher, even after a SIGKILL), so no rank outlives a killed flow.

Only for ranks that train on the CPU of a machine without a GPU: a server that had touched CUDA
could not give a forked child a working GPU, and a GPU rank's start is dominated by other work
(``StandbyLaunch`` and the compile cache handle those). ``reliability.fork_cpu_ranks`` turns it off.

Engine code: ``run_ranks`` (megatrain/launch/ranks.py) runs a ``ForkLaunch`` in place of a
torchrun command; the flow's ``launch-ranks`` task picks it (tasks/train.py).
"""

from __future__ import annotations

import atexit
import collections
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver, popen_forkserver, spawn, util
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerProcess, reduction, set_spawning_popen
from pathlib import Path

from megatrain.launch.process_exit import exit_after_handlers
from megatrain.launch.standby import RankGroup, rank_env, rank_lines

# What the server imports once: a rank's modules and what its first calls import
# (Optimizer.__init__ imports torch._dynamo; DeepSpeed's ZeRO check its Muon module). A name that
# does not import (an older DeepSpeed) is skipped by the server.
PRELOAD = ["megatrain.launch.forked", "megatrain.training.rank", "megatrain.training.trainer", "torch._dynamo",
           "deepspeed.runtime.zero.muon.muon_optimizer"]
RANK_MODULE = "megatrain.train"  # what each rank runs, as ``python -m megatrain.train`` would

_START_LOCK = threading.Lock()  # one rank at a time hands its pipe to the server
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the ForkedRanks this launcher started


@atexit.register
def _kill_the_left() -> None:
    """A launcher that exits with forked processes still running (its supervision was cut short)
    kills them, as the kernel kills a torchrun job's with the agent; registered after
    multiprocessing's own exit handler, so it runs first: that one would wait for them."""
    for rank in list(_LIVE):
        if rank.poll() is None:
            try:
                os.killpg(rank.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class _RankPopen(popen_forkserver.Popen):
    """The standard library's forkserver start, less one thing: the child does not re-run the
    launcher's ``__main__`` (a Prefect engine, the CLI) as ``__mp_main__``, seconds of imports
    and side effects a rank has no use for. The rest is the library's ``_launch`` as it is."""

    def _launch(self, process_obj):
        prep_data = {key: value for key, value in spawn.get_preparation_data(process_obj._name).items()
                     if key not in ("init_main_from_name", "init_main_from_path")}
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of this process, as the library keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _RankProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


def forking_suits(device: str) -> bool:
    """Whether ranks of ``train.device`` may be forked: they train on the CPU of a machine where
    torch sees no GPU. (On a GPU machine even CPU ranks start fresh: DeepSpeed's import in the
    server asks CUDA for its devices, and a child of a process that initialised the driver cannot
    use it.)"""
    if device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


class ForkedRank:
    """One forked rank, seen through the parts of ``subprocess.Popen`` the launcher uses
    (``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``): its exit code is the server's
    report of it, negative for a signal as Popen's is."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout, stderr=None) -> None:
        self.process = process
        self.pid = process.pid
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = None
        _LIVE.add(self)

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(RANK_MODULE, timeout)
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Read the output to its end and wait for the exit, as ``Popen.communicate`` does:
        (stdout, stderr), stderr None where it went to stdout."""
        found: dict[str, str] = {}

        def read(name: str, stream) -> None:
            found[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(10)  # EOF follows the exit unless a child of it holds the pipe
        return found.get("out", ""), found.get("err")


@dataclass
class ForkLaunch:
    """What ``run_ranks`` starts in place of a torchrun command: one node's ``nproc_per_node``
    ranks of ``python -m megatrain.train argv``, forked from the launcher's warm server."""

    argv: list[str]
    nproc_per_node: int
    module: str = RANK_MODULE
    script: str | None = None  # a file to run in place of the module, as ``python FILE`` would

    def start(self, env: dict[str, str] | None, cwd: str | Path | None, on_line: Callable[[str], None],
              tail: collections.deque) -> RankGroup:
        from megatrain.launch.ranks import _pump, free_port

        base = dict(os.environ if env is None else env)
        port = free_port()
        tails = [collections.deque(maxlen=400) for _ in range(self.nproc_per_node)]
        procs, pumps = [], []
        for rank in range(self.nproc_per_node):
            order = {"env": {**base, **rank_env(rank, self.nproc_per_node, port)}, "module": self.module,
                     "script": self.script, "argv": list(self.argv),
                     "cwd": str(cwd) if cwd is not None else os.getcwd()}
            proc = fork_rank(order)
            pump = threading.Thread(target=_pump, args=(proc.stdout, rank_lines(tails[rank], tail, on_line)),
                                    daemon=True)
            pump.start()
            procs.append(proc)
            pumps.append(pump)
        return RankGroup(procs, tails, pumps)

    def prepare_next(self, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        """Nothing to prepare: the server stays warm for the next attempt."""

    def release(self, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        """Nothing to release: the server serves the launcher's later launches too."""


class CollectedRun:
    """A launch's ranks running with their output lines collected, for a caller with no
    supervision of its own (a script, a test): start several, then ``finish`` each."""

    def __init__(self, launch: ForkLaunch, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        self.lines: list[str] = []
        self.group = launch.start(env, cwd, self.lines.append, collections.deque(maxlen=1))

    def finish(self, timeout_s: float) -> tuple[int | None, str]:
        """Wait until the ranks end (the first failure stops the rest): the exit code (the first
        failed rank's; None after ``timeout_s``, when they are killed) and the output."""
        code = self.group.wait(timeout_s)
        if code is None:
            self.group.stop(grace_s=0)
        for pump in self.group.pumps:
            pump.join(10)
        return code, "\n".join(self.lines)


def run_to_end(launch: ForkLaunch, env: dict[str, str] | None, cwd: str | Path | None,
               timeout_s: float) -> tuple[int | None, str]:
    """``launch`` run until it ends: (exit code, output), as ``CollectedRun.finish`` gives."""
    return CollectedRun(launch, env, cwd).finish(timeout_s)


def start_module(module: str, argv: list[str], env: dict[str, str] | None = None,
                 cwd: str | Path | None = None) -> ForkedRank:
    """``python -m module ARGV`` forked from the warm server, started now (stdout and stderr apart):
    a command a script or test would otherwise start as a fresh interpreter."""
    order = {"env": dict(os.environ if env is None else env), "module": module, "argv": list(argv),
             "cwd": str(cwd if cwd is not None else os.getcwd())}
    return fork_rank(order, separate_stderr=True)


def run_module(module: str, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """``start_module`` to its end, as ``subprocess.run(capture_output=True, text=True)`` gives it;
    after ``timeout_s`` the process is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = start_module(module, argv, env, cwd)
    try:
        out, err = proc.communicate(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess([module, *argv], proc.returncode, out, err)


def fork_rank(order: dict, separate_stderr: bool = False) -> ForkedRank:
    """Fork one process from the warm server that runs ``order["module"]`` as ``__main__`` with
    ``order["argv"]``, ``order["env"]`` (the whole environment) in ``order["cwd"]``. Its stdout
    and stderr come back as text through one pipe, the result's ``stdout`` (as a rank's, with
    ``stderr=STDOUT``), or with ``separate_stderr`` through two, ``stdout`` and ``stderr``."""
    pipes = [os.pipe() for _ in range(2 if separate_stderr else 1)]
    with _START_LOCK:
        writers = [Connection(w, readable=False) for _, w in pipes]  # pickled to the server as fd duplicates
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first fork)
        process = _RankProcess(target=become, args=(order, writers[0], writers[-1]), daemon=False)
        try:
            process.start()
        finally:
            for writer in writers:
                writer.close()  # the child holds its own copies: EOF reaches us when it exits
    streams = [os.fdopen(r, "r", encoding="utf-8", errors="replace") for r, _ in pipes]
    return ForkedRank(process, streams[0], streams[1] if separate_stderr else None)


def become(order: dict, out: Connection, err: Connection) -> None:
    """The forked child: become ``python -m order["module"] *order["argv"]`` (``python
    order["script"] ...`` where one is given) and exit with its
    code, without returning to the server's code (runs in the child only)."""
    import runpy

    from megatrain.launch.ranks import die_with_parent

    os.setsid()  # its own session, as torchrun's workers and Popen(start_new_session=True) have
    # The server hands each child its end of the launcher's "alive" pipe, so that it outlives
    # the launcher while children run; a rank must not keep it up: the server is to exit when
    # the launcher goes (EOF of that pipe), and the rank with it.
    if forkserver._forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    die_with_parent()  # the server's exit (the launcher died) kills it
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # a fresh interpreter's handlers, not the server's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    for stream in (sys.stdout, sys.stderr):  # PYTHONUNBUFFERED, as the launch's environment asks
        stream.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(order["env"])
    import tempfile

    tempfile.tempdir = None  # found again from this environment's TMPDIR, not the server's
    os.chdir(order["cwd"])
    script = order.get("script")
    extra = [p for p in order["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = [str(Path(script).parent) if script else order["cwd"], *extra]  # as ``python`` would see them
    _reseed_like_a_new_process()
    if "OMP_NUM_THREADS" in order["env"]:  # read by torch when it was imported, in the server
        import torch

        torch.set_num_threads(int(order["env"]["OMP_NUM_THREADS"]))
    sys.argv = [script or order["module"], *order["argv"]]
    retitle([sys.executable, *([script] if script else ["-m", order["module"]]), *order["argv"]])
    code = 0
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(order["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback, then exit code 1)
        import traceback

        traceback.print_exc()
        code = 1
    exit_after_handlers(code, join_threads=False)  # not back into multiprocessing's child code


def retitle(argv: list[str]) -> bool:
    """Make this process's command line (``ps``, /proc/PID/cmdline) read ``argv`` instead of the
    fork server's, so that operators, their scripts and this project's process-table checks see
    a rank as a rank: written over the kernel's argument area through /proc/self/mem, cut to the
    server's length (a long ``-c`` command). False where that cannot be done."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of stat)
        title = "\0".join(argv).encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(title + b"\0" * (end - start - len(title)))
        return True
    except (OSError, ValueError, IndexError):
        return False


def _reseed_like_a_new_process() -> None:
    """Python's and NumPy's global generators from OS entropy, as in a fresh interpreter: forked
    children would otherwise all draw the server's one stream (torch is seeded by the trainer)."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
