"""Which addresses a process tree listens on, read from /proc the way an operator's ``ss -ltnp``
would (no psutil): each process's socket inodes (/proc/<pid>/fd) matched against the listening
rows of its network namespace's /proc/<pid>/net/tcp and tcp6.

``ListeningSockets`` samples this process and all its descendants (ranks, torchrun agents, fork
server, keepers, Dask workers, the Prefect server) in a thread while a campaign runs, since most
of the sockets exist only during an attempt."""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp*


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback

    def __str__(self) -> str:
        return f"{self.address}:{self.port} (pid {self.pid}: {self.command})"


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # the kernel prints each 32-bit word of the address in host (little-endian) order
    return str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))


def listening_rows(pid: int | str = "self") -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) for every listening TCP socket of ``pid``'s network namespace."""
    rows = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                hex_ip, hex_port = fields[1].split(":")
                rows[fields[9]] = (_address(hex_ip), int(hex_port, 16))
    return rows


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (by parent pid; a new session does not hide one)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def listeners(root: int) -> set[Listener]:
    """The listening sockets of ``root``'s tree (each process's in its own network namespace)."""
    tables: dict[str, dict[str, tuple[str, int]]] = {}
    found = set()
    for pid in descendants(root):
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
            if namespace not in tables:
                tables[namespace] = listening_rows(pid)
            rows = tables[namespace]
            fds = os.listdir(f"/proc/{pid}/fd")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in rows:
                found.add(Listener(pid, command.strip()[:160], *rows[target[8:-1]]))
    return found


class ListeningSockets:
    """Every listener of this process's tree seen while the ``with`` block runs (sampled every
    ``interval_s``; the thread is joined on exit)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.seen: set[Listener] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="listening-sockets", daemon=True)

    def _sample(self) -> None:
        while True:
            self.seen |= listeners(os.getpid())
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> ListeningSockets:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def exposed(self) -> list[str]:
        """The listeners on an address other than loopback, one line each."""
        return sorted(str(listener) for listener in self.seen if not listener.loopback)

    def of(self, marker: str) -> list[Listener]:
        """The listeners of processes whose command line holds ``marker``."""
        return [listener for listener in self.seen if marker in listener.command]
