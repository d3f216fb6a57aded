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
by the first rank that finds none (memory.py); one per key (a node's staging dir) thanks to
an exclusive flock. It ends on ``shutdown`` (the run finished), on SIGTERM, or when no rank has
been connected for ``idle_s``. Because the slots are anonymous memory, nothing is left behind
in /dev/shm even after a SIGKILL: the memory goes when the last process mapping it is gone.

Wire format: every message is an 8-byte length plus a JSON object, with file descriptors attached
to the length bytes; no pickle (a snapshot is data). Requests: ``alloc``, ``seal``, ``list``,
``get``, ``drop``, ``shutdown``; each gets one reply (``{"ok": false, "error": ...}`` on failure).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import secrets
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("megatrain.keeper")

SOCKET, LOCK = "keeper.sock", "keeper.lock"
CHUNK = 64 << 20  # hash granularity: chunks hash in parallel threads (hashlib releases the GIL)
_HEADER = struct.Struct("!Q")
_HASH_THREADS = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="keeper-hash")


# ---- the wire: length-prefixed JSON, descriptors attached to the length ----------------------------

def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    payload = json.dumps(message).encode()
    header = _HEADER.pack(len(payload))
    if fds:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it. ConnectionError when the peer is gone."""
    header, fds = b"", []
    while len(header) < _HEADER.size:
        data, ancdata, _, _ = sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(4 * 16))
        if not data:
            raise ConnectionError("keeper connection closed")
        header += data
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", blob[:len(blob) - len(blob) % 4]))
    (size,) = _HEADER.unpack(header)
    payload = bytearray()
    while len(payload) < size:
        data = sock.recv(min(size - len(payload), 1 << 20))
        if not data:
            raise ConnectionError("keeper connection closed")
        payload += data
    return json.loads(payload), fds


# ---- checksums (used by the keeper at seal and by a rank at restore) -------------------------------

def chunk_hashes(buffer: memoryview, nbytes: int) -> list[str]:
    """sha256 of each CHUNK of the first ``nbytes``, computed in parallel."""
    spans = [(start, min(start + CHUNK, nbytes)) for start in range(0, nbytes, CHUNK)] or [(0, 0)]
    return list(_HASH_THREADS.map(lambda span: hashlib.sha256(buffer[span[0]:span[1]]).hexdigest(), spans))


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the keeper's state ----------------------------------------------------------------------------

class Slot:
    """One anonymous shared-memory file, and what was sealed into it (None: free or being written)."""

    def __init__(self, name: str, nbytes: int):
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.nbytes = nbytes
        self.map = mmap.mmap(self.fd, max(nbytes, 1))
        self.generation = secrets.token_hex(4)  # with the keeper's instance: the id a rank caches its mapping by
        self.sealed: dict[str, Any] | None = None

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class Keeper:
    def __init__(self, root: Path, idle_s: float):
        self.root, self.idle_s = root, idle_s
        self.instance = secrets.token_hex(4)  # a slot's id names its keeper: a new keeper, new ids
        self.slots: dict[int, list[Slot | None]] = {}  # rank -> [slot 0, slot 1]
        self.lock = threading.Lock()
        self.connections = 0
        self.last_seen = time.monotonic()
        self.stopping = threading.Event()

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = request.get("op")
        if op == "alloc":
            return self._alloc(int(request["rank"]), int(request["nbytes"]))
        if op == "seal":
            return self._seal(request), []
        if op == "list":
            return {"ok": True, "instance": self.instance, "pid": os.getpid(), "ranks": self._list()}, []
        if op == "get":
            return self._get(int(request["rank"]), int(request["step"]))
        if op == "drop":
            return self._drop(int(request["rank"]), int(request.get("after_step", -1))), []
        if op == "shutdown":
            self.stopping.set()
            return {"ok": True}, []
        return {"ok": False, "error": f"unknown request {op!r}"}, []

    def _alloc(self, rank: int, nbytes: int) -> tuple[dict[str, Any], list[int]]:
        with self.lock:
            pair = self.slots.setdefault(rank, [None, None])
            index = self._spare(pair)
            slot = pair[index]
            if slot is None or slot.nbytes != nbytes:  # the first save, or the state changed size
                if slot is not None:
                    slot.close()
                slot = pair[index] = Slot(f"megatrain-rank{rank}-slot{index}", nbytes)
            slot.sealed = None  # being rewritten: no longer a copy of anything
            return {"ok": True, "slot": index, "id": f"{self.instance}-{slot.generation}", "nbytes": nbytes}, [slot.fd]

    @staticmethod
    def _spare(pair: list[Slot | None]) -> int:
        """The slot to write next: never the newest sealed copy."""
        steps = [slot.sealed["step"] if slot is not None and slot.sealed else -1 for slot in pair]
        return 0 if steps[0] < steps[1] else 1 if steps[0] > steps[1] else 0

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
        return {"ok": True, "hash_s": time.perf_counter() - start}

    def _list(self) -> dict[str, list[dict[str, Any]]]:
        with self.lock:
            return {str(rank): [{"slot": i, "step": s.sealed["step"], "bytes": s.sealed["used"]}
                                for i, s in enumerate(pair) if s is not None and s.sealed]
                    for rank, pair in self.slots.items()}

    def _get(self, rank: int, step: int) -> tuple[dict[str, Any], list[int]]:
        with self.lock:
            for index, slot in enumerate(self.slots.get(rank, [])):
                if slot is not None and slot.sealed and slot.sealed["step"] == step:
                    return {"ok": True, "slot": index, "nbytes": slot.nbytes, **slot.sealed}, [slot.fd]
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
                send_message(conn, reply, reply_fds)
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
                threading.Thread(target=self.serve_connection, args=(conn,), daemon=True).start()
        finally:
            path.unlink(missing_ok=True)
            server.close()
        log.info("keeper %s exits", self.instance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="megatrain's per-node checkpoint keeper (started by the ranks)")
    parser.add_argument("--dir", required=True, help="the keeper's folder: socket and lock")
    parser.add_argument("--idle-s", type=float, default=600.0, help="exit after this long with no rank connected")
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
    try:
        keeper.run()
    finally:  # still holding the lock: nobody else uses the folder now (a SIGKILL leaves this empty folder)
        (root / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            root.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
