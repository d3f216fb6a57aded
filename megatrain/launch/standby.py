"""Warm standby: the next attempt's rank processes, started and imported while this one trains.

On CPU ranks most of a restart's time to first step is Python importing torch, DeepSpeed and what
their first calls pull in (``torch.optim.Optimizer.__init__`` imports ``torch._dynamo``, DeepSpeed's
ZeRO check its Muon module): 15-20 s of a 35-40 s restart here. A standby process does that work
ahead of time, then waits on its stdin (launch -> first step of a restart under chaos: 4.7-7.0 s
before, 0.6-1.3 s with it on an idle machine; benchmarks/RESULTS.md, "ETTR under chaos"):

    python -m megatrain.training.standby   # imports, then blocks reading one line
    {"env": {"RANK": "1", ...}, "argv": ["--config", ...], "handed_over_at": <time>}

This module is the launcher's side; the process's side (priority, imports, becoming the rank) is
``megatrain/training/standby.py``. The launcher hands each process its rank (the environment
torchrun would set) and it runs ``megatrain.training.rank.main`` as that rank; its start-up timer counts from the hand-over, so the
breakdown shows what the restart itself cost. The launcher supervises the handed-over ranks as
torchrun would (the first rank to fail stops the others, which are killed, not asked: their
state is in the last committed checkpoint) and, once the new attempt has trained a step, starts
the next standby set at the lowest CPU priority (SCHED_IDLE), so it imports in the CPU time the
ranks leave idle.

Engine code: ``run_ranks`` (megatrain/launch/ranks.py) runs a ``StandbyLaunch`` in place of a torchrun
command; ``reliability.warm_standby`` turns it on for a stage's ``launch-ranks`` task.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROCESS_MODULE = "megatrain.training.standby"  # what each standby process runs (its side of the pipe)
READY_LINE = "megatrain: standby ready"  # printed once the imports are done
STANDBY_INDEX_ENV = "MEGATRAIN_STANDBY_INDEX"  # which process of its set: the local rank it will be handed


def rank_env(rank: int, world: int, master_port: int) -> dict[str, str]:
    """The variables torchrun sets for one worker of a one-node job (megatrain.parallel.init reads
    them; without torchrun's agent, rank 0 hosts the TCP store)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "TORCHELASTIC_RESTART_COUNT": "0"}


class StandbySet:
    """``nproc`` standby processes, each in its own session, importing. Their output is read from
    the start (so ``ready`` can be told) and held until the hand-over attaches a reader."""

    def __init__(self, nproc: int, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        from megatrain.launch.ranks import die_with_parent

        base = dict(os.environ if env is None else env)
        self.procs = [  # process i becomes local rank i at the hand-over: it may ready that GPU now
            subprocess.Popen([sys.executable, "-m", PROCESS_MODULE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             start_new_session=True, preexec_fn=die_with_parent,
                             env={**base, STANDBY_INDEX_ENV: str(index)}, cwd=cwd)
            for index in range(nproc)
        ]
        self.ready = [threading.Event() for _ in self.procs]
        self._held: list[list[str]] = [[] for _ in self.procs]
        self._readers: list[Callable[[str], None] | None] = [None] * nproc
        self._lock = threading.Lock()
        self.pumps = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(nproc)]
        for pump in self.pumps:
            pump.start()

    def _read(self, index: int) -> None:
        stream = self.procs[index].stdout
        for line in iter(stream.readline, ""):
            line = line.rstrip("\n")
            if line == READY_LINE:
                self.ready[index].set()
            with self._lock:
                reader = self._readers[index]
                if reader is None:
                    self._held[index].append(line)
            if reader is not None:
                reader(line)
        stream.close()

    def attach(self, index: int, reader: Callable[[str], None]) -> None:
        """Send process ``index``'s output to ``reader``: what it printed so far, then every line."""
        with self._lock:
            held, self._held[index] = self._held[index], []
            self._readers[index] = reader
        for line in held:
            reader(line)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every process finished its imports within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(event.wait(max(0.0, deadline - time.monotonic())) for event in self.ready)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            _kill_session(proc)


@dataclass
class RankGroup:
    """Handed-over standby processes, supervised as torchrun supervises its workers: ``poll()``
    is None while every rank runs and none failed; the first failure kills the rest."""

    procs: list[subprocess.Popen]
    tails: list[collections.deque]
    pumps: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None
    first_failure: dict | None = None  # {rank, exitcode, signal, error}, as launch.root_cause gives

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed and self.first_failure is None:
            from megatrain.launch.ranks import last_error

            rank, code = failed[0]
            sig = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else None
            self.first_failure = {"rank": rank, "exitcode": code, "signal": sig, "error": last_error(self.tails[rank])}
            self.stop(grace_s=0.0)  # the survivors wait in a collective on a dead peer: nothing to save
            self.returncode = code
        elif all(code == 0 for code in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """Until the group ends or ``timeout`` passes (a rank's exit is seen within 50 ms)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.returncode

    def stop(self, grace_s: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None and grace_s > 0:
                _signal_session(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_session(proc)
        if self.returncode is None:
            codes = [p.returncode for p in self.procs]
            self.returncode = next((c for c in codes if c != 0), 0)
        for pump in self.pumps:
            pump.join(timeout=5)


def rank_lines(rank_tail: collections.deque, tail: collections.deque,
               on_line: Callable[[str], None]) -> Callable[[str], None]:
    """Where one rank's output lines go: its own tail (its root cause), the job's tail, the caller."""
    def lines(line: str) -> None:
        rank_tail.append(line)
        tail.append(line)
        on_line(line)
    return lines


@dataclass
class StandbyLaunch:
    """What ``run_ranks`` starts in place of a torchrun command: one node's ``nproc_per_node``
    ranks of ``megatrain.train`` with ``argv``, from a warm standby set when one is waiting."""

    argv: list[str]
    nproc_per_node: int

    def start(self, env: dict[str, str] | None, cwd: str | Path | None, on_line: Callable[[str], None],
              tail: collections.deque) -> RankGroup:
        from megatrain.launch.ranks import free_port

        ready = take_standby(self.nproc_per_node, env, cwd)
        port, handed_over_at = free_port(), time.time()
        tails = [collections.deque(maxlen=400) for _ in ready.procs]
        group = RankGroup(ready.procs, tails, ready.pumps)
        for rank, proc in enumerate(ready.procs):
            order = {"env": rank_env(rank, self.nproc_per_node, port), "argv": self.argv,
                     "handed_over_at": handed_over_at}
            try:
                proc.stdin.write(json.dumps(order) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died while waiting: the group reports its exit and output
                pass

            ready.attach(rank, rank_lines(tails[rank], tail, on_line))
        return group

    def prepare_next(self, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        """Start the next attempt's standby set now (it waits, importing, until a restart)."""
        key = standby_key(self.nproc_per_node, env, cwd)
        with _LOCK:
            waiting = _WAITING.get(key)
            if waiting is None or not waiting.alive():
                _WAITING[key] = StandbySet(self.nproc_per_node, env, cwd)

    def release(self, env: dict[str, str] | None, cwd: str | Path | None) -> None:
        """No further attempt will come (the stage completed or cannot be retried): stop the set."""
        with _LOCK:
            waiting = _WAITING.pop(standby_key(self.nproc_per_node, env, cwd), None)
        if waiting is not None:
            waiting.close()


# One waiting set per (nproc, environment, cwd): the environment a rank imports under must be the
# one it would have been launched with (PYTHONPATH, OMP_NUM_THREADS).
_WAITING: dict[tuple, StandbySet] = {}
_LOCK = threading.Lock()


def standby_key(nproc: int, env: dict[str, str] | None, cwd: str | Path | None) -> tuple:
    return nproc, tuple(sorted((env if env is not None else os.environ).items())), str(cwd)


def take_standby(nproc: int, env: dict[str, str] | None, cwd: str | Path | None) -> StandbySet:
    """The waiting set for this launch if it is still alive, else a new one (a cold start: it
    imports now, as torchrun's workers would)."""
    with _LOCK:
        waiting = _WAITING.pop(standby_key(nproc, env, cwd), None)
    if waiting is not None and waiting.alive():
        return waiting
    if waiting is not None:
        waiting.close()
    return StandbySet(nproc, env, cwd)


@atexit.register
def _close_all() -> None:
    with _LOCK:
        sets = list(_WAITING.values())
        _WAITING.clear()
    for waiting in sets:
        waiting.close()


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:  # a forked rank in its first instant, before its setsid (forked.py)
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process's session (its own children too) and reap it."""
    _signal_session(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


