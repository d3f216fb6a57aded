"""The checkpoint keeper: one long-lived process per node that holds its ranks' newest RAM snapshots.

Why a process of its own: a rank that crashes takes its memory with it, so a copy that must
survive the crash has to live elsewhere, and reading it back from host memory takes seconds where
the durable store takes minutes. The keeper is that elsewhere (Gemini, DLRover's flash checkpoint
and NVRx's local checkpoints do the same).

How the bytes get there without a second copy: for each local rank the keeper owns two slots,
each an anonymous shared-memory file (``memfd_create``). A rank asks for a slot (``alloc``), gets
its file descriptor over the Unix socket (SCM_RIGHTS), maps it and copies its state from the device
straight into it; then it asks the keeper to ``seal`` the slot at a step. Sealing hashes the bytes
(sha256 per 64 MiB chunk, in the keeper's threads, while the rank trains on) and makes the slot
one of the rank's sealed copies. ``alloc`` always hands out the slot that is *not* the newest
sealed one, so the newest copy is never overwritten, and the one before it stays readable until
the next ``alloc``: a rank killed while copying leaves the other ranks' keepers with a step it
also holds (the restore takes the newest step every rank holds, see memory.py).

Lifetime: started detached (its own session, so a launcher's killpg of the ranks does not reach it)
by the campaign flow before a stage (tied to the flow process: tasks/keepers.py), or by the first
rank that finds none (memory.py); one per key (a node's staging dir) thanks to an exclusive
flock. It ends on ``shutdown`` (the run finished, or the flow's stage ended), on SIGTERM, or when
no rank has been connected for ``idle_s``. Because the slots are anonymous memory, nothing is left behind
in /dev/shm even after a SIGKILL: the memory goes when the last process mapping it is gone.

Peer tier (keeper_peer.py): with ``--registry`` and the run token, sealed copies are also sent to
the next node's keeper, and this keeper holds the previous node's.

Wire format (keeper_wire.py): an 8-byte length plus a JSON object, descriptors attached.
Requests: ``alloc``, ``seal``, ``list``, ``get`` (``replica``: another node's copy held here),
``drop``, ``shutdown``; each gets one reply (``{"ok": false, "error": ...}`` on failure).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from megatrain.checkpoint.keeper_peer import PeerTier, Registry
from megatrain.checkpoint.keeper_wire import (
    Slot,
    chunk_hashes,
    recv_message,
    send_message,
    spare_slot,
)
from megatrain.checkpoint.serve_thread import serve_in_thread
from megatrain.launch.run_token import run_token

log = logging.getLogger("megatrain.keeper")

SOCKET, LOCK = "keeper.sock", "keeper.lock"


class Keeper:
    def __init__(self, root: Path, idle_s: float):
        self.root, self.idle_s = root, idle_s
        self.instance = secrets.token_hex(4)  # a slot's id names its keeper: a new keeper, new ids
        self.slots: dict[int, list[Slot | None]] = {}  # rank -> [slot 0, slot 1]
        self.lock = threading.Lock()
        self.connections = 0
        self.last_seen = time.monotonic()
        self.stopping = threading.Event()
        self.peer: PeerTier | None = None  # when this node replicates to a peer node

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = request.get("op")
        if op == "alloc":
            return self._alloc(int(request["rank"]), int(request["nbytes"]))
        if op == "seal":
            return self._seal(request), []
        if op == "list":
            return {"ok": True, "instance": self.instance, "pid": os.getpid(), "ranks": self._list(),
                    "writing": self._writing(), "peer": self.peer.status() if self.peer is not None else None}, []
        if op == "get" and request.get("replica"):  # another node's copy held here (inspection, tests)
            found = self.peer.replica(int(request["rank"]), int(request["step"])) if self.peer is not None else None
            if found is None:
                return {"ok": False, "error": f"rank {request['rank']}: no replica of step {request['step']}"}, []
            return {"ok": True, "nbytes": found[0].nbytes, **found[1]}, [found[0].fd]
        if op == "get":
            return self._get(int(request["rank"]), int(request["step"]))
        if op == "drop":
            return self._drop(int(request["rank"]), int(request.get("after_step", -1))), []
        if op == "shutdown":  # serve_connection stops the keeper once this reply is sent
            return {"ok": True}, []
        return {"ok": False, "error": f"unknown request {op!r}"}, []

    def _alloc(self, rank: int, nbytes: int) -> tuple[dict[str, Any], list[int]]:
        with self.lock:
            pair = self.slots.setdefault(rank, [None, None])
            index = spare_slot(pair)
            slot = pair[index]
            if slot is None or slot.nbytes != nbytes:  # the first save, or the state changed size
                if slot is not None:
                    slot.close()
                slot = pair[index] = Slot(f"megatrain-rank{rank}-slot{index}", nbytes)
            slot.sealed, slot.writing = None, True  # being rewritten: no longer a copy of anything
            return {"ok": True, "slot": index, "id": f"{self.instance}-{slot.generation}", "nbytes": nbytes}, [slot.fd]

    def _seal(self, request: dict[str, Any]) -> dict[str, Any]:
        rank, index, used = int(request["rank"]), int(request["slot"]), int(request["used"])
        slot = self.slots.get(rank, [None, None])[index]
        if slot is None or used > slot.nbytes:
            return {"ok": False, "error": f"rank {rank} slot {index}: not allocated for {used} bytes"}
        start = time.perf_counter()
        hashes = chunk_hashes(memoryview(slot.map), used)  # outside the lock: other ranks seal meanwhile
        with self.lock:
            slot.sealed = {"step": int(request["step"]), "used": used, "chunks": hashes,
                           "entries": request["entries"], "json": request["json"], "json_sha256": request["json_sha256"],
                           "sealed_at": time.time()}
            slot.writing = False
        if self.peer is not None:  # off the rank's path: the peer tier's own thread sends it
            self.peer.sealed(rank, int(request["step"]))
        return {"ok": True, "hash_s": time.perf_counter() - start}

    def _list(self) -> dict[str, list[dict[str, Any]]]:
        with self.lock:
            return {str(rank): [{"slot": i, "step": s.sealed["step"], "bytes": s.sealed["used"]}
                                for i, s in enumerate(pair) if s is not None and s.sealed]
                    for rank, pair in self.slots.items()}

    def _writing(self) -> dict[str, list[int]]:
        """rank -> its slots handed out and not sealed yet (a copy in flight; a fault test waits for it)."""
        with self.lock:
            return {str(rank): [i for i, s in enumerate(pair) if s is not None and s.writing]
                    for rank, pair in self.slots.items() if any(s is not None and s.writing for s in pair)}

    def _get(self, rank: int, step: int) -> tuple[dict[str, Any], list[int]]:
        with self.lock:
            for index, slot in enumerate(self.slots.get(rank, [])):
                if slot is not None and slot.sealed and slot.sealed["step"] == step:
                    return {"ok": True, "slot": index, "id": f"{self.instance}-{slot.generation}",
                            "nbytes": slot.nbytes, **slot.sealed}, [slot.fd]
        return {"ok": False, "error": f"rank {rank}: no sealed copy of step {step}"}, []

    def _drop(self, rank: int, after_step: int) -> dict[str, Any]:
        """Forget this rank's copies newer than ``after_step`` (an abandoned timeline's)."""
        dropped = []
        with self.lock:
            for slot in self.slots.get(rank, []):
                if slot is not None and slot.sealed and slot.sealed["step"] > after_step:
                    dropped.append(slot.sealed["step"])
                    slot.sealed = None
        return {"ok": True, "dropped": dropped}

    # ---- serving ----------------------------------------------------------------------------------

    def serve_connection(self, conn: socket.socket) -> None:
        with self.lock:
            self.connections += 1
        try:
            while not self.stopping.is_set():
                request, fds = recv_message(conn)
                for fd in fds:  # clients send none; never leak one that came anyway
                    os.close(fd)
                try:
                    reply, reply_fds = self.handle(request)
                except Exception as exc:  # a bad request must not end the keeper
                    log.exception("request %s failed", request.get("op"))
                    reply, reply_fds = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
                try:
                    send_message(conn, reply, reply_fds)
                finally:  # a shutdown whose asker has gone stops the keeper all the same
                    if request.get("op") == "shutdown" and reply.get("ok"):
                        # only now: set earlier, the accept loop could end the process before the
                        # reply left, and the asker (stop_keeper) would read "no keeper answered"
                        self.stopping.set()
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            with self.lock:
                self.connections -= 1
                self.last_seen = time.monotonic()

    def run(self) -> None:
        """Accept connections until shut down, or idle for ``idle_s`` with nobody connected."""
        path = self.root / SOCKET
        path.unlink(missing_ok=True)  # a dead keeper's socket (we hold the lock: it is dead)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(64)
        server.settimeout(0.5)
        log.info("keeper %s (pid %d) serving %s, idle exit after %.0f s", self.instance, os.getpid(), path, self.idle_s)
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    with self.lock:
                        idle = self.connections == 0 and time.monotonic() - self.last_seen > self.idle_s
                    if idle:
                        log.info("no rank connected for %.0f s: exiting", self.idle_s)
                        break
                    continue
                conn.settimeout(None)
                serve_in_thread(self.serve_connection, conn)  # bounded: a full memory ends the keeper
        finally:
            path.unlink(missing_ok=True)
            server.close()
        log.info("keeper %s exits", self.instance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="megatrain's per-node checkpoint keeper (started by the ranks)")
    parser.add_argument("--dir", required=True, help="the keeper's folder: socket and lock")
    parser.add_argument("--idle-s", type=float, default=600.0, help="exit after this long with no rank connected")
    parser.add_argument("--node", type=int, default=0, help="this node's index (the peer ring's order)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the run: above 1, replicate to node+1")
    parser.add_argument("--registry", help="where keepers register host:port: a folder or a redis:// URL")
    parser.add_argument("--run-id", default="run", help="names the run's registry entries in Redis")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper %(levelname)s %(message)s")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    lock = os.open(root / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another keeper holds %s: exiting", root / LOCK)
        return 0
    keeper = Keeper(root, args.idle_s)
    signal.signal(signal.SIGTERM, lambda *_: keeper.stopping.set())
    if args.registry:
        if run_token():
            keeper.peer = PeerTier(keeper, args.node, args.nnodes, Registry(args.registry, args.run_id), run_token())
            keeper.peer.start()
        else:
            log.warning("no run token (MEGATRAIN_RUN_TOKEN): the peer tier is off, a peer could not tell this "
                        "run's copies from a foreign process's")
    try:
        keeper.run()
    finally:  # still holding the lock: nobody else uses the folder now (a SIGKILL leaves this empty folder)
        (root / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            root.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
