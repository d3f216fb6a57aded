"""A node's checkpoint keeper seen from outside: where it lives, starting it, asking it, stopping it.

The ranks (memory.py) start a keeper when none answers; the campaign flow (tasks/keepers.py)
starts one per node before a stage's first attempt and stops every one of the stage's keepers
when the stage ends, however it ends; the fault injector kills or corrupts one on purpose. None of
them needs torch, so this module does not import it (the flow never loads torch).

A keeper is found by its folder (``keeper_dir``: derived from the node's staging dir, so every
rank and attempt of a node, and the flow, reach the same one); its Unix socket answers requests
(keeper.py lists them), and ``list`` names its pid.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.checkpoint.keeper import SOCKET
from megatrain.checkpoint.keeper_log import gone_message, note_log
from megatrain.checkpoint.keeper_wire import recv_message, send_message
from megatrain.waits import waiting

KEEPER_ROOT_ENV = "MEGATRAIN_KEEPER_ROOT"  # where keeper folders live (default: the temp dir)
KEEPER_IDLE_ENV = "MEGATRAIN_KEEPER_IDLE_S"  # a keeper with no rank connected exits after this long
DEFAULT_IDLE_S = 600.0  # long enough for a flow to relaunch its ranks; short enough not to hoard RAM
# A keeper answers list, get, alloc and drop in milliseconds; one that is stopped (SIGSTOP) or
# wedged never does, while the kernel still accepts connections on its socket.
REQUEST_DEADLINE_S = 5.0
SEAL_DEADLINE_S = 120.0  # a seal hashes the whole copy in the keeper (18 GB: ~2 s on an H200 host)


class KeeperError(RuntimeError):
    """The keeper refused a request or could not be reached."""


class KeeperTimeout(KeeperError):
    """The keeper did not answer within the request's deadline (stopped, wedged): the caller takes
    the next tier, and does not ask it again for a while."""


@dataclass(frozen=True)
class PeerSettings:
    """This node's place in the keepers' replication ring, and where keepers register."""
    node: int
    nnodes: int
    registry: str  # a folder shared by the nodes, or a redis:// URL
    run_id: str

    @classmethod
    def of_run(cls, cfg: Any, node: int, nnodes: int) -> PeerSettings:
        """A run's keepers register in its Redis, else in a folder of its run dir (nodes sharing a
        file system): the ranks (checkpoint/manager.py) and the flow (tasks/keepers.py) alike."""
        return cls(node, nnodes, cfg.reliability.redis_url or str(Path(cfg.train.run_dir) / "keepers"), cfg.run_id)

    def args(self) -> list[str]:
        return ["--node", str(self.node), "--nnodes", str(self.nnodes), "--registry", self.registry,
                "--run-id", self.run_id]


def keeper_dir(staging_dir: str | Path) -> Path:
    """The keeper folder of a node's staging dir (short: a Unix socket path has ~100 bytes)."""
    key = hashlib.sha1(os.path.realpath(staging_dir).encode()).hexdigest()[:12]
    return Path(os.environ.get(KEEPER_ROOT_ENV) or tempfile.gettempdir()) / f"megatrain-keeper-{key}"


def start_keeper(folder: Path, log_path: Path, peer: PeerSettings | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
    """Start a keeper detached from the caller's process group: its own session (a launcher's
    killpg of the ranks does not reach it). A rank passes no ``preexec_fn``, so the keeper outlives
    it; the flow passes one that ties the keeper's life to its own (``die_with_parent``). A second
    keeper started by a racing rank finds the lock taken and exits at once. The run token reaches
    it by the inherited environment, never its command line (anyone on the host reads those)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    idle = os.environ.get(KEEPER_IDLE_ENV, str(DEFAULT_IDLE_S))
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "megatrain.checkpoint.keeper", "--dir", str(folder),
                                 "--idle-s", idle, *(peer.args() if peer is not None else [])],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, preexec_fn=preexec_fn)


class KeeperClient:
    """One connection to a keeper; requests are serialised (the training and seal threads share it).
    Each request has a deadline and shows in the heartbeat while it waits (megatrain/waits.py)."""

    def __init__(self, sock: socket.socket, path: str = "?"):
        self.sock, self._lock, self.path = sock, threading.Lock(), path
        self.pid = _peer_pid(sock)  # the keeper's, from the kernel: a stopped keeper tells nothing

    @classmethod
    def connect(cls, folder: Path, start_log: Path | None = None, timeout_s: float = 30.0,
                peer: PeerSettings | None = None) -> KeeperClient:
        """Connect to the keeper of ``folder``; with ``start_log``, start one when none answers."""
        deadline, started = time.monotonic() + timeout_s, False
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(REQUEST_DEADLINE_S)  # a full backlog of a stopped keeper blocks connect too
                sock.connect(str(folder / SOCKET))
                note_log(folder, sock)  # where it writes: its cause of death, should it die
                return cls(sock, str(folder / SOCKET))
            except OSError as exc:
                sock.close()
                if start_log is None or time.monotonic() > deadline:
                    raise KeeperError(gone_message(folder, folder / SOCKET, exc, start_log)) from None
            if not started:
                start_keeper(folder, start_log, peer)
                started = True
            time.sleep(0.05)

    def request(self, op: str, deadline_s: float | None = None, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        deadline_s = deadline_s or (SEAL_DEADLINE_S if op == "seal" else REQUEST_DEADLINE_S)
        with self._lock, waiting(f"checkpoint keeper: {op}", self.path, deadline_s, self.pid) as wait:
            try:
                self.sock.settimeout(wait.remaining())
                send_message(self.sock, {"op": op, **fields})
                reply, fds = recv_message(self.sock, until=time.monotonic() + wait.remaining())
            except TimeoutError:  # a late reply would answer the next request: this connection is done
                self.sock.close()
                raise KeeperTimeout(str(wait.timeout(_state(self.pid)))) from None
            except OSError as exc:  # ConnectionError included: the keeper died
                raise KeeperError(f"checkpoint keeper: {op}: {exc}") from exc
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise KeeperError(f"checkpoint keeper: {op}: {reply.get('error')}")
        return reply, fds

    def close(self) -> None:
        self.sock.close()


def ask(folder: Path, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
    """One request to the keeper of ``folder`` over a connection of its own (KeeperError: none answers)."""
    client = KeeperClient.connect(folder, timeout_s=0)
    try:
        return client.request(op, **fields)
    finally:
        client.close()


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    except (OSError, AttributeError, struct.error):
        return None


def _state(pid: int | None) -> str:
    """What /proc says of the keeper's process (``T``: stopped by a signal), for the timeout's line."""
    if pid is None:
        return "pid unknown"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            code = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "process not visible here"
    return {"T": "process stopped by a signal", "t": "process stopped by a debugger", "D": "process in "
            "uninterruptible I/O", "Z": "process exited"}.get(code, f"process state {code}")


def _gone(pid: int) -> bool:
    """The process ended (a zombie counts: it holds no memory and answers nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def stop_keeper(folder: Path, timeout_s: float = 10.0) -> int | None:
    """Shut down the keeper of ``folder`` and wait until its process is gone (SIGKILL after
    ``timeout_s``); returns its pid, or None when no keeper answered there."""
    try:
        pid = int(ask(folder, "list")[0]["pid"])
        ask(folder, "shutdown")
    except KeeperError:
        return None
    for sig, wait_s in ((None, timeout_s), (signal.SIGKILL, 5.0)):
        if sig is not None and not _gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return pid
