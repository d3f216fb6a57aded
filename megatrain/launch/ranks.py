"""Run a stage's training ranks as a child process tree and watch it until it ends.

The child is ``torchrun`` in its own process session (so one ``killpg`` stops every rank), tied
to this process with PR_SET_PDEATHSIG (so the ranks die with their parent, even after SIGKILL),
its output streamed line by line to a callback, and watched by the heartbeat watcher: a dead or
hung rank gets its Python stack collected, then the whole job is stopped. The result says how the
attempt ended (completed, anomaly with the trainer's verdict, hung, crashed, timeout).

Engine code: the Prefect launch task calls ``run_ranks`` with its logger as the callback.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatrain.config import Config

from megatrain.errors import DETERMINISTIC_PREFIX, EXIT_ANOMALY, EXIT_DETERMINISTIC, EXIT_OK  # noqa: F401


@dataclass
class LaunchResult:
    status: str  # completed | anomaly | deterministic | hung | crashed | timeout
    returncode: int | None
    wall_s: float
    message: str = ""
    verdict: dict | None = None
    faulty_ranks: list[int] = field(default_factory=list)
    root_cause: dict | None = None  # crashed: torchrun's first failure {rank, exitcode, signal, error}

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def write_run_config(cfg: Config, path: str | Path) -> Path:
    """Freeze a fully resolved config to YAML: what the ranks run is exactly what was validated."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(config_path: str | Path, nproc_per_node: int, overrides: list[str] | None = None) -> list[str]:
    """One node's ranks, torchrun's agent hosting their store on 127.0.0.1 only (megatrain.launch.torchrun)."""
    return [
        sys.executable, "-m", "megatrain.launch.torchrun", "--nproc-per-node", str(nproc_per_node),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "megatrain.train", "--config", str(config_path), *(overrides or []),
    ]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (used as the launcher's
    preexec_fn, and by each rank under torchrun, so no rank outlives a killed flow)."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the whole session, then SIGKILL what is left after the grace period."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _pump(stream, on_line: Callable[[str], None], tail: collections.deque | None = None) -> None:
    for line in iter(stream.readline, ""):
        line = line.rstrip("\n")
        on_line(line)
        if tail is not None:
            tail.append(line)
    stream.close()


# "pkg.mod.SomeError: what", as a traceback ends; torchrun prefixes a worker's lines "[rank3]: ".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)*\w*(?:Error|Exception|Interrupt)): (.+)$")


def _deterministic_error(lines) -> str:
    """The cause a rank printed before exiting with EXIT_DETERMINISTIC (see megatrain.errors)."""
    for line in lines:
        _, found, cause = line.partition(DETERMINISTIC_PREFIX)
        if found:
            return cause.strip()
    return ""


def last_error(lines) -> str:
    """The last exception a rank printed (``SomeError: what``), skipping torchrun's own summary
    (ChildFailedError), so that a crash names its cause (e.g. the bad shard)."""
    for line in reversed(list(lines)):
        match = _EXCEPTION_LINE.match(line.strip())
        if match and not match.group(1).endswith("ChildFailedError"):
            return f"{match.group(1)}: {match.group(2)}"
    return ""


# torchrun's "Root Cause (first observed failure):" block: "rank      : 1 (local_rank: 1)" then
# "exitcode  : -9 (pid: 10498)  (SIGKILL)".
_ROOT_CAUSE_HEADER = "Root Cause (first observed failure):"
_FIELD_LINE = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)(?:.*\((SIG\w+)\))?")


def root_cause(lines) -> dict | None:
    """The first rank that failed, as torchrun itself reports it (its peers' failures, e.g. rank
    0's gloo "Connection closed by peer" after rank 1 was killed, are consequences): ``{"rank",
    "exitcode", "signal", "error"}``, where ``error`` is the last exception that rank printed
    (torchrun prefixes a worker's lines with ``[rankN]:``). None without such a block."""
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.strip() == _ROOT_CAUSE_HEADER]
    if not starts:
        return None
    found: dict = {}
    for line in lines[starts[-1] + 1:]:
        match = _FIELD_LINE.match(line)
        if match:
            found[match.group(1)] = int(match.group(2))
            if match.group(3):
                found["signal"] = match.group(3)
        if line.startswith("====") and found:
            break
    if "rank" not in found:
        return None
    prefix = f"[rank{found['rank']}]:"
    own = [line for line in lines if line.startswith(prefix)]
    return {"rank": found["rank"], "exitcode": found.get("exitcode"), "signal": found.get("signal"),
            "error": last_error(own)}


def describe_root_cause(cause: dict, step: int | None = None) -> str:
    """One sentence: "rank 1 was killed by SIGKILL (exit code -9) in step 5"."""
    at = f" in step {step}" if step is not None else ""
    if cause.get("signal"):
        return f"rank {cause['rank']} was killed by {cause['signal']} (exit code {cause['exitcode']}){at}"
    error = f": {cause['error']}" if cause.get("error") else ""
    return f"rank {cause['rank']} exited with code {cause['exitcode']}{at}{error}"


def run_ranks(
    command,
    *,
    on_line: Callable[[str], None] = print,
    watcher=None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    verdict_reader: Callable[[], dict | None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_fault: Callable[[object], None] | None = None,
) -> LaunchResult:
    """Start ``command`` in its own session and supervise it until it exits or is stopped.

    ``command``: a torchrun command line, or a ``megatrain.launch.standby.StandbyLaunch`` (the ranks come
    from a warm standby set, and the next set starts once this attempt has trained a step).
    ``watcher``: a ``HeartbeatWatcher`` (or None); a fault it reports stops the job at once (a
    dead or hung job has nothing to save: its state is the last committed checkpoint).
    ``verdict_reader``: returns the trainer's anomaly verdict (as a dict) after an EXIT_ANOMALY.
    ``should_stop``: polled; True (the flow run was cancelled) stops the job.
    ``on_fault``: called with the watcher's result when it reports a fault, before the job stops
    (the flow draws who hung from it).
    """
    start = time.monotonic()
    tail: collections.deque = collections.deque(maxlen=400)
    standby = None if isinstance(command, list) else command
    if standby is not None:
        job = standby.start(env, cwd, on_line, tail)
        stop = job.stop
        next_prepared = False
    else:
        job = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True, preexec_fn=die_with_parent, env=env, cwd=cwd,
        )
        pump = threading.Thread(target=_pump, args=(job.stdout, on_line, tail), daemon=True)
        pump.start()

        def stop(grace_s: float = 10.0) -> None:
            stop_process_group(job, grace_s)
            pump.join(timeout=5)
    result = None
    try:
        while _wait(job, poll_s) is None:
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                stop()
                return LaunchResult("timeout", job.returncode, time.monotonic() - start,
                                    f"stage attempt exceeded {timeout_s:.0f} s and was stopped")
            if should_stop is not None and should_stop():
                stop()
                return LaunchResult("crashed", job.returncode, time.monotonic() - start, "stopped on request")
            if watcher is not None and job.poll() is None:
                result = watcher.check()
                for note in result.notes:  # the store went down or came back, a rank turned slow
                    on_line(f"[watcher] {note}")
                if not result.ok:
                    on_line(f"[watcher] {result.headline()}")  # the verdict's time, before stacks and stop
                    stacks = watcher.collect_stacks(result, result.faulty)
                    if on_fault is not None:
                        on_fault(result)
                    stop(grace_s=0.0)
                    return LaunchResult("hung", job.returncode, time.monotonic() - start,
                                        result.message(stacks), faulty_ranks=result.faulty)
            if standby is not None and not next_prepared and _trained_a_step(result, watcher):
                standby.prepare_next(env, cwd)  # imports beside the training, at low priority
                next_prepared = True
    finally:
        stop()  # on any exception (or a cancelled task) no rank outlives us

    outcome = _outcome(job, tail, time.monotonic() - start, verdict_reader)
    if standby is not None and outcome.status in ("completed", "deterministic"):
        standby.release(env, cwd)  # no attempt follows
    return outcome


def _wait(job, timeout_s: float) -> int | None:
    """The job's exit code, waiting up to ``timeout_s`` (an exit is seen at once, not a poll later)."""
    if isinstance(job, subprocess.Popen):
        try:
            return job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    return job.wait(timeout_s)


def _trained_a_step(result, watcher) -> bool:
    """Every rank has finished a step (per the last heartbeat check; at once without a watcher)."""
    if watcher is None:
        return True
    return (result is not None and len(result.records) == watcher.world_size
            and all(r.first_step_done and r.timestamp >= watcher.since for r in result.records.values()))


def _outcome(job, tail, wall: float, verdict_reader) -> LaunchResult:
    """How a job that exited by itself ended, from its exit code, the verdict and its output."""
    if job.returncode == EXIT_OK:
        return LaunchResult("completed", 0, wall)
    verdict = verdict_reader() if verdict_reader is not None else None
    if job.returncode == EXIT_ANOMALY or verdict is not None:
        return LaunchResult("anomaly", job.returncode, wall, (verdict or {}).get("message", "anomaly"), verdict)
    deterministic = _deterministic_error(tail)
    if job.returncode == EXIT_DETERMINISTIC or deterministic:
        return LaunchResult("deterministic", job.returncode, wall, deterministic or "a rank failed deterministically")
    first = getattr(job, "first_failure", None) or root_cause(tail)
    if first is not None:
        return LaunchResult("crashed", job.returncode, wall, describe_root_cause(first), root_cause=first)
    cause = last_error(tail)
    return LaunchResult("crashed", job.returncode, wall,
                        f"ranks exited with code {job.returncode}" + (f": {cause}" if cause else ""))
