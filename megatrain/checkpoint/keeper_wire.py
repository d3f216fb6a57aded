"""The keeper's building blocks, shared by the keeper (keeper.py), its peer tier (keeper_peer.py)
and the ranks (memory.py): the wire format, chunk checksums, a shared-memory slot, and between
nodes the registry and the token-authenticated TCP channel (why: see keeper_peer.py).

Wire format: every message is an 8-byte length plus a JSON object, with file descriptors attached
to the length bytes (over the node's Unix socket; TCP between keepers carries none); no pickle (a
snapshot is data).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatrain.launch.run_token import token_scope

CHUNK = 64 << 20  # hash granularity: chunks hash in parallel threads (hashlib releases the GIL)
_HEADER = struct.Struct("!Q")
# Every core: a restore waits on these (18.4 GB of the 1.3B state at ~1.5 GB/s a core).
_HASH_THREADS = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1), thread_name_prefix="keeper-hash")


# ---- the wire: length-prefixed JSON, descriptors attached to the length ----------------------------

def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    payload = json.dumps(message).encode()
    header = _HEADER.pack(len(payload))
    if fds:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def recv_message(sock: socket.socket, limit: int = 1 << 30,
                 until: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it. ConnectionError when the peer is gone;
    ValueError for a length over ``limit`` (a stranger on TCP must not make us allocate at will);
    TimeoutError once ``until`` (time.monotonic()) passes, however the bytes trickle in."""
    def bound() -> None:
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)

    header, fds = b"", []
    while len(header) < _HEADER.size:
        bound()
        data, ancdata, _, _ = sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(4 * 16))
        if not data:
            raise ConnectionError("keeper connection closed")
        header += data
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", blob[:len(blob) - len(blob) % 4]))
    (size,) = _HEADER.unpack(header)
    if size > limit:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a message of {size} bytes (at most {limit} here)")
    payload = bytearray()
    while len(payload) < size:
        bound()
        data = sock.recv(min(size - len(payload), 1 << 20))
        if not data:
            raise ConnectionError("keeper connection closed")
        payload += data
    return json.loads(payload), fds


# ---- checksums (used by the keeper at seal and by a rank at restore) -------------------------------

def chunk_hashes(buffer: memoryview, nbytes: int) -> list[str]:
    """sha256 of each CHUNK of the first ``nbytes``, computed in parallel."""
    return [future.result() for future in chunk_hashes_started(buffer, nbytes)]


def chunk_hashes_started(buffer: memoryview, nbytes: int) -> list[Future]:
    """chunk_hashes, started: one future per chunk, so the caller can work while they run."""
    spans = [(start, min(start + CHUNK, nbytes)) for start in range(0, nbytes, CHUNK)] or [(0, 0)]
    return [_HASH_THREADS.submit(lambda a, b: hashlib.sha256(buffer[a:b]).hexdigest(), a, b) for a, b in spans]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the keeper's state ----------------------------------------------------------------------------

def spare_slot(pair: list[Slot | None]) -> int:
    """The slot to write next: never the newest sealed copy."""
    steps = [slot.sealed["step"] if slot is not None and slot.sealed else -1 for slot in pair]
    return 0 if steps[0] < steps[1] else 1 if steps[0] > steps[1] else 0


class Slot:
    """One anonymous shared-memory file, and what was sealed into it (None: free or being written)."""

    def __init__(self, name: str, nbytes: int):
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.nbytes = nbytes
        self.map = mmap.mmap(self.fd, max(nbytes, 1))
        self.generation = secrets.token_hex(4)  # with the keeper's instance: the id a rank caches its mapping by
        self.sealed: dict[str, Any] | None = None
        self.writing = False  # handed out by alloc and not sealed since (a rank is copying into it)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


# ---- between nodes: TCP, authenticated by the run token (keeper_peer.py) ----------------------------

PROTOCOL = "megatrain-keeper-peer/1"
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 60.0  # each read from a peer keeper: a copy in flight may be large, a stopped peer ends the wait


class PeerError(RuntimeError):
    """A peer refused, failed authentication or could not be reached."""


# ---- the registry: node id -> host:port ------------------------------------------------------------

class Registry:
    """Where keepers of one run find each other: a folder, or a Redis hash (``redis://...``)."""

    def __init__(self, spec: str, run_id: str):
        self.spec, self.run_id = spec, run_id
        self.key = f"megatrain:{token_scope()}keepers:{run_id}"

    def _redis(self):
        from megatrain.launch.redis_client import (
            connect,  # only a Redis registry needs the client
        )
        return connect(self.spec, socket_timeout=5, socket_connect_timeout=5)

    def register(self, node: int, address: str) -> None:
        if self.spec.startswith("redis"):
            self._redis().hset(self.key, str(node), address)
            return
        folder = Path(self.spec)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".node-{node}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
        os.replace(tmp, folder / f"node-{node}.json")  # atomic: a reader sees the old entry or the new

    def addresses(self) -> dict[int, str]:
        if self.spec.startswith("redis"):
            return {int(k): v.decode() for k, v in self._redis().hgetall(self.key).items()}
        found = {}
        for path in Path(self.spec).glob("node-*.json"):
            try:
                found[int(path.stem.removeprefix("node-"))] = json.loads(path.read_text())["address"]
            except (OSError, ValueError, KeyError):
                continue  # being replaced, or not ours to read
        return found


# ---- an authenticated channel ----------------------------------------------------------------------

def _mac(key: bytes, *parts: bytes) -> str:
    return hmac.new(key, b"|".join(parts), hashlib.sha256).hexdigest()


class Channel:
    """A TCP connection after the mutual token handshake; JSON messages carry a sequenced HMAC."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes):
        self.sock, self.key, self.side = sock, key, side
        self.sent = self.received = 0

    @classmethod
    def client(cls, address: str, token: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Channel:
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello, _ = recv_message(sock, limit=4096)
            if hello.get("hello") != PROTOCOL:
                raise PeerError(f"{address} is not a megatrain keeper ({hello.get('hello')!r})")
            theirs, ours = hello["nonce"].encode(), secrets.token_hex(16).encode()
            send_message(sock, {"nonce": ours.decode(), "proof": _mac(token.encode(), b"client", theirs, ours)})
            answer, _ = recv_message(sock)
            if not answer.get("ok") or not hmac.compare_digest(answer.get("proof", ""),
                                                               _mac(token.encode(), b"server", theirs, ours)):
                raise PeerError(f"keeper at {address}: authentication failed ({answer.get('error', 'bad proof')})")
        except (OSError, ValueError, KeyError) as exc:
            raise PeerError(f"keeper at {address}: {type(exc).__name__}: {exc}") from exc
        sock.settimeout(READ_TIMEOUT_S)  # a copy in flight may be large; a dead peer must still end the wait
        return cls(sock, hmac.new(token.encode(), b"session|" + theirs + b"|" + ours, hashlib.sha256).digest(), b"c")

    @classmethod
    def server(cls, sock: socket.socket, token: str) -> Channel:
        ours = secrets.token_hex(16).encode()
        send_message(sock, {"hello": PROTOCOL, "nonce": ours.decode()})
        answer, fds = recv_message(sock, limit=4096)  # before authentication: a nonce and a proof, no more
        for fd in fds:
            os.close(fd)
        theirs = str(answer.get("nonce", "")).encode()
        if not hmac.compare_digest(str(answer.get("proof", "")), _mac(token.encode(), b"client", ours, theirs)):
            send_message(sock, {"ok": False, "error": "authentication failed: not this run's token"})
            raise PeerError("a peer connection without this run's token was refused")
        send_message(sock, {"ok": True, "proof": _mac(token.encode(), b"server", ours, theirs)})
        return cls(sock, hmac.new(token.encode(), b"session|" + ours + b"|" + theirs, hashlib.sha256).digest(), b"s")

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message, sort_keys=True).encode()
        self.sent += 1
        send_message(self.sock, {"body": body.decode(), "mac": _mac(self.key, self.side, str(self.sent).encode(), body)})

    def recv(self) -> dict[str, Any]:
        wrapped, fds = recv_message(self.sock)
        for fd in fds:
            os.close(fd)
        self.received += 1
        body, other = str(wrapped.get("body", "")).encode(), b"s" if self.side == b"c" else b"c"
        if not hmac.compare_digest(str(wrapped.get("mac", "")), _mac(self.key, other, str(self.received).encode(), body)):
            raise PeerError("a message failed its HMAC: tampered, replayed or not from this run")
        return json.loads(body)

    def send_bytes(self, data: memoryview) -> None:
        self.sock.sendall(data)

    def recv_into(self, target: memoryview) -> None:
        got = 0
        while got < len(target):
            n = self.sock.recv_into(target[got:], min(len(target) - got, 4 << 20))
            if not n:
                raise ConnectionError("peer closed the connection mid-copy")
            got += n

    def close(self) -> None:
        self.sock.close()
