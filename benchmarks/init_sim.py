"""Replay megatrain's start-up store traffic (``init_traffic.rank_program``) for thousands of
simulated ranks against a real redis-server and a real libuv TCPStore server.

Each simulated rank is an asyncio task with its own TCP connection speaking the server's wire
protocol, issuing exactly the requests megatrain's store client would: for Redis those of
``megatrain.parallel.redis_store.RedisStore`` (set and add in a MULTI with the notify RPUSH,
compare_set as one EVALSHA, wait as EXISTS then BLPOP + RPUSH on the notify list); for the
TCPStore those of torch's C++ client (VALIDATE, then SET / GET / ADD / COMPARE_SET / WAIT,
where a get is WAIT + GET). The server's CPU time (user + system, from /proc) is the measured
cost; the clients' Python is not the server's and is excluded from it (it is in the wall time).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import time

import psutil

# ---------------------------------------------------------------------------------------------
# Redis: RESP over one connection per rank


def _resp(*args: bytes | str | int) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


async def _read_reply(reader: asyncio.StreamReader):
    line = await reader.readline()
    kind, rest = line[:1], line[1:-2]
    if kind in (b"+", b":"):
        return int(rest) if kind == b":" else rest
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else (await reader.readexactly(n + 2))[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [await _read_reply(reader) for _ in range(n)]
    raise RuntimeError(f"bad reply {line!r}")


class RedisRank:
    """One simulated rank's RedisStore client (namespace ``prefix``)."""

    def __init__(self, reader, writer, prefix: str, compare_set_sha: bytes):
        self.reader, self.writer, self.prefix, self.sha = reader, writer, prefix, compare_set_sha
        self.requests = 0

    async def call(self, *commands: tuple) -> list:
        self.writer.write(b"".join(_resp(*c) for c in commands))
        self.requests += len(commands)
        return [await _read_reply(self.reader) for _ in commands]

    async def set(self, key: str, value: bytes = b"1") -> None:
        k = self.prefix + key
        await self.call(("MULTI",), ("SET", k, value), ("RPUSH", k + ".ready", "1"), ("EXEC",))

    async def add(self, key: str, amount: int) -> int:
        k = self.prefix + key
        replies = await self.call(("MULTI",), ("INCRBY", k, amount), ("RPUSH", k + ".ready", "1"), ("EXEC",))
        return int(replies[-1][0])

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        k = self.prefix + key
        return (await self.call(("EVALSHA", self.sha, 2, k, k + ".ready", expected, desired)))[0]

    async def wait(self, key: str) -> None:
        k = self.prefix + key
        while not (await self.call(("EXISTS", k)))[0]:
            if (await self.call(("BLPOP", k + ".ready", 30)))[0] is not None:
                await self.call(("RPUSH", k + ".ready", "1"))

    async def get(self, key: str) -> bytes:
        await self.wait(key)
        return (await self.call(("GET", self.prefix + key)))[0]


# ---------------------------------------------------------------------------------------------
# TCPStore: torch's binary protocol (c10d TCPStoreBackend: a one-byte query type, strings and
# payloads as a uint64 length then bytes, integers as native int64)

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = range(7)
MAGIC = 0x3C85F7CE


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


class TCPStoreRank:
    def __init__(self, reader, writer, prefix: str):
        self.reader, self.writer, self.prefix = reader, writer, prefix.encode()
        self.requests = 0
        writer.write(bytes([VALIDATE]) + struct.pack("<I", MAGIC))

    async def _vector(self) -> bytes:
        (n,) = struct.unpack("<Q", await self.reader.readexactly(8))
        return await self.reader.readexactly(n)

    async def set(self, key: str, value: bytes = b"1") -> None:
        self.requests += 1
        self.writer.write(bytes([SET]) + _str(self.prefix + key.encode()) + _str(value))

    async def add(self, key: str, amount: int) -> int:
        self.requests += 1
        self.writer.write(bytes([ADD]) + _str(self.prefix + key.encode()) + struct.pack("<q", amount))
        return struct.unpack("<q", await self.reader.readexactly(8))[0]

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.requests += 1
        self.writer.write(bytes([COMPARE_SET]) + _str(self.prefix + key.encode()) + _str(expected) + _str(desired))
        return await self._vector()

    async def check(self, key: str) -> bool:
        self.requests += 1
        self.writer.write(bytes([CHECK]) + struct.pack("<Q", 1) + _str(self.prefix + key.encode()))
        return (await self.reader.readexactly(1)) == b"\x00"  # READY

    async def wait(self, key: str) -> None:
        self.requests += 1
        self.writer.write(bytes([WAIT]) + struct.pack("<Q", 1) + _str(self.prefix + key.encode()))
        assert (await self.reader.readexactly(1)) == b"\x00"  # STOP_WAITING

    async def get(self, key: str) -> bytes:
        await self.wait(key)
        self.requests += 1
        self.writer.write(bytes([GET]) + _str(self.prefix + key.encode()))
        return await self._vector()


# ---------------------------------------------------------------------------------------------
# replay


async def run_program(client, rank: int, program: list[tuple]) -> int:
    """One rank's start-up program; returns its store operations (as a CountingStore counts)."""
    ops = 0
    for op in program:
        kind, key = op[0], op[1]
        if kind == "compare_set":
            me = b"rank%d" % rank
            owner = await client.compare_set(key, b"", me)
            assert owner == me, f"{key} already claimed by {owner!r}"
            ops += 1
        elif kind == "barrier":  # the join barrier: add; the n-th arrival releases
            if await client.add(key + "/count", 1) == op[2]:
                await client.set(key + "/done")
                ops += 1
            await client.wait(key + "/done")
            ops += 2
        elif kind == "store_barrier":  # torch's _store_based_barrier
            await client.add(key, 1)
            if await client.add(key, 0) == op[2]:
                await client.set(key + ":last_worker")
                ops += 1
            await client.wait(key + ":last_worker")
            ops += 3
        elif kind == "set":
            await client.set(key, b"x" * 64)  # an address / unique id: tens of bytes
            ops += 1
        elif kind == "get":
            await client.get(key)
            ops += 2
        else:
            raise ValueError(op)
    return ops


# The libuv TCPStore server looks up each client's address (a DNS PTR query per connection, for its
# logs; a loopback client shows up as ::ffff:127.0.0.1, which /etc/hosts does not list). This
# sandbox's resolver loses about one query in 25, and each loss stalls the server's whole event
# loop for the resolver's 5 s timeout (measured with strace). The server therefore runs with a
# preloaded getnameinfo that answers numerically, built here with the system's C compiler, so the
# measurement is about the store, not the resolver; without a compiler, lookups fail fast instead
# (RES_OPTIONS, a 1 s stall per lost query).
_NUMERIC_NAMES = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
typedef int (*fn_t)(const struct sockaddr*, socklen_t, char*, socklen_t, char*, socklen_t, int);
int getnameinfo(const struct sockaddr* sa, socklen_t salen, char* host, socklen_t hostlen,
                char* serv, socklen_t servlen, int flags) {
  fn_t real = (fn_t)dlsym(RTLD_NEXT, "getnameinfo");
  return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}
"""


def _server_env() -> dict[str, str]:
    import shutil
    import tempfile

    lib = os.path.join(tempfile.gettempdir(), "megatrain-numeric-names.so")
    if not os.path.exists(lib) and shutil.which("cc"):
        src = lib[:-3] + ".c"
        with open(src, "w") as handle:
            handle.write(_NUMERIC_NAMES)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, src, "-ldl"], check=False)
    if os.path.exists(lib):
        return {"LD_PRELOAD": lib}
    return {"RES_OPTIONS": "timeout:0 attempts:1"}


def start_tcpstore_server(port: int = 0) -> subprocess.Popen:
    """A libuv TCPStore server in its own process; ``proc.port`` is the port it listens on.

    Port 0 (the default) lets the server bind a free port itself: a port found free beforehand
    can be taken by another process while this one imports torch (seen on a busy machine)."""
    code = ("import sys, time, datetime, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, None, True, timeout=datetime.timedelta(seconds=3600), "
            "wait_for_workers=False, use_libuv=True)\n"
            "print('ready', s.port, flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **_server_env()})
    line = proc.stdout.readline().split()
    if line[:1] != ["ready"]:
        proc.kill()
        raise RuntimeError(f"the TCPStore server did not start (exit {proc.wait()}): see its stderr above")
    proc.port = int(line[1])  # type: ignore[attr-defined]
    return proc


def start_redis(n: int = 0, attempts: int = 5) -> tuple[subprocess.Popen, int]:
    """redis-server (no password, no persistence) on a free port, once it answers PING; a port
    taken between the probe and the bind makes the server exit, and the next free one is tried."""
    import redis as redis_py

    for _ in range(attempts):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--maxclients", str(n + 1000)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    return proc, port
                except redis_py.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        proc.kill()
        proc.wait()
    raise RuntimeError(f"redis-server did not start on a free port in {attempts} attempts")


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def _replay(kind: str, port: int, programs: list[list[tuple]], prefix: str, connect_limit: int) -> dict:
    # Connects are admitted ``connect_limit`` at a time: on this machine more than ~32 connects
    # pending at once on the libuv TCPStore stall ~5 s (its accept backlog; measured), which
    # would measure the kernel's retransmission timer rather than the store.
    gate = asyncio.Semaphore(connect_limit)
    sha = None
    if kind == "redis":
        from megatrain.parallel.redis_store import _COMPARE_SET

        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_resp("SCRIPT", "LOAD", _COMPARE_SET))
        sha = await _read_reply(r)
        w.close()

    async def one(rank: int):
        async with gate:  # connected = the server answered one request (accepted, not just queued)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # as torch's and redis-py's clients do: no Nagle delay between a write and the next
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if kind == "redis":
                client = RedisRank(reader, writer, prefix, sha)
                await client.call(("PING",))
            else:
                client = TCPStoreRank(reader, writer, prefix)
                await client.check("connect")
        ops = await run_program(client, rank, programs[rank])
        return ops, client.requests, writer

    results = await asyncio.gather(*(one(r) for r in range(len(programs))))
    for _, _, writer in results:
        writer.close()
    return {"ops": sum(r[0] for r in results), "requests": sum(r[1] for r in results)}


def replay(kind: str, port: int, server_pid: int, programs: list[list[tuple]], prefix: str,
           connect_limit: int = 32) -> dict:
    """Run every rank's program at once; the server's CPU seconds and the wall seconds."""
    cpu0, wall0 = cpu_seconds(server_pid), time.perf_counter()
    counts = asyncio.run(_replay(kind, port, programs, prefix, connect_limit))
    wall = time.perf_counter() - wall0
    return {**counts, "server_cpu_s": cpu_seconds(server_pid) - cpu0, "wall_s": wall}


def raise_fd_limit(need: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        raise RuntimeError(f"need {need} open files, the limit is {hard}")


if __name__ == "__main__":  # a smoke test: 64 ranks, both servers
    sys.path.insert(0, os.path.dirname(__file__))
    from init_traffic import rank_program

    from megatrain.parallel.dims import ParallelDims
    dims = ParallelDims(dp=2, tp=8, pp=4)
    programs = [rank_program(r, dims, "nccl", "ordered", eager=False) for r in range(dims.world_size)]
    tcp = start_tcpstore_server()
    print("tcp", replay("tcp", tcp.port, tcp.pid, programs, "t/"))
    tcp.kill()
    red, red_port = start_redis()
    print("redis", replay("redis", red_port, red.pid, programs, "megatrain:sim:store:"))
    red.kill()
