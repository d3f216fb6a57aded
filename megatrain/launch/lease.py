"""One writer per campaign and per run dir: an exclusive, heartbeated lease.

Two runs of the same campaign id at once would resume from each other's commits, delete staging
files under each other and interleave ``metrics.jsonl``. So whoever writes takes a lease first,
and a second run refuses at once, naming the owner (or waits, bounded, when asked).

The lease is a JSON record (owner, host, pid, the pid's start time, start time, heartbeat) kept
in one of two places:

- a lock file (``<dir>/lease.json``): every acquire, takeover, refresh and release reads and
  replaces it inside an ``flock`` on ``lease.json.guard``, so two contenders cannot both win,
  and the guard is released by the kernel when its holder dies (it never goes stale itself);
- a Redis key (``reliability.redis_url``; campaigns spread over hosts): ``SET NX`` with a TTL,
  refreshed and released only by the holder (compare-and-set scripts).

A lease is *stale*, and taken over, when its owner's process is gone (same host: the pid is dead
or now belongs to another process) or its heartbeat is older than ``stale_after_s``. The holder
refreshes the heartbeat from a thread (writing the record again if it vanished: a restarted
Redis comes back empty); if it finds another holder's record (it was suspended past the
timeout and taken over), it stops refreshing and calls ``on_lost``.

A holder of an older fencing epoch (``launch/fencing.py``: its attempt was fenced by a newer one,
e.g. its host was cut off and the stage went on without it) is stale too, whatever its heartbeat
says: a partitioned host's rank 0 keeps refreshing a lease on a shared volume it still reaches.

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatrain.errors import MegatrainError
from megatrain.waits import waiting

LEASE_FILE = "lease.json"
GUARD_DEADLINE_S = 10.0  # the guard is held for microseconds; a holder that keeps it this long is stopped


class LeaseHeld(MegatrainError):
    """Another live run holds the lease."""

    def __init__(self, where: str, holder: LeaseRecord) -> None:
        self.holder = holder
        super().__init__(f"{where} is in use by {holder.describe()}; wait for it to finish or stop it")


def _flock_holder(path: Path) -> int | None:
    """The pid holding an flock on ``path`` (from /proc/locks), or None."""
    try:
        inode = os.stat(path).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
                return int(fields[4])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/<pid>/stat): tells a live owner from
    a new process that reuses a dead owner's pid. None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped (an orphan waits for pid 1): holds nothing
        return None
    return fields[19]


@dataclass
class LeaseRecord:
    owner: str  # who: e.g. "flow run 1d3f..." or "megatrain train"
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    pid_start: str | None = field(default_factory=lambda: _process_start(os.getpid()))
    started: float = field(default_factory=time.time)
    heartbeat: float = field(default_factory=time.time)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)  # this holding, not this process
    epoch: int | None = None  # the holder attempt's fencing epoch, where its launcher issued one

    def describe(self) -> str:
        age = time.time() - self.heartbeat
        return (f"{self.owner} (pid {self.pid} on {self.host}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}, heartbeat {age:.0f} s ago)")

    def stale_reason(self, stale_after_s: float, epoch: int | None = None) -> str | None:
        """Why this holder is gone (None: it looks alive); ``epoch``: the contender's fencing epoch."""
        if epoch is not None and self.epoch is not None and self.epoch < epoch:
            return f"its attempt's epoch {self.epoch} is fenced by epoch {epoch}"
        if self.host == socket.gethostname():
            start = _process_start(self.pid)
            if start is None:
                return f"pid {self.pid} on {self.host} is dead"
            if self.pid_start is not None and start != self.pid_start:
                return f"pid {self.pid} on {self.host} is another process now"
        age = time.time() - self.heartbeat
        if age > stale_after_s:
            return f"heartbeat {age:.0f} s old (> {stale_after_s:.0f} s)"
        return None

    @classmethod
    def parse(cls, raw: str | bytes) -> LeaseRecord:
        return cls(**json.loads(raw))


class FileLeaseStore:
    """The lease as ``<directory>/lease.json``, changed only under an flock on its guard file."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LEASE_FILE
        self.where = str(self.directory)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The guard's flock, held for microseconds (a read and a rename) by whoever holds it; a
        holder stopped while it holds it (SIGSTOP) would block everyone: waited for until
        ``GUARD_DEADLINE_S``, then a ``WaitTimeout`` naming the file and the holder's pid."""
        self.directory.mkdir(parents=True, exist_ok=True)
        guard = self.path.with_name(LEASE_FILE + ".guard")
        with open(guard, "a") as handle, waiting("lease guard (flock)", str(guard), GUARD_DEADLINE_S) as wait:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if wait.expired():
                        holder = _flock_holder(guard)
                        wait.pid = holder
                        raise wait.timeout("its holder does not let go") from None
                    time.sleep(0.01)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _read(self) -> LeaseRecord | None:
        try:
            return LeaseRecord.parse(self.path.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # a torn or foreign file: nobody valid holds it
            return None

    def _write(self, record: LeaseRecord) -> None:
        tmp = self.path.with_name(f"{LEASE_FILE}.{record.token}.tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.path)  # atomic: a reader sees the old record or the new one

    def swap(self, record: LeaseRecord, allowed: Callable[[LeaseRecord | None], bool]) -> tuple[bool, LeaseRecord | None]:
        """Write ``record`` if ``allowed(current)``: (written, the record found before)."""
        with self._guard():
            current = self._read()
            if allowed(current):
                self._write(record)
                return True, current
            return False, current

    def delete(self, token: str) -> None:
        with self._guard():
            current = self._read()
            if current is not None and current.token == token:
                self.path.unlink()


class RedisLeaseStore:
    """The lease as a Redis key with a TTL (a dead owner's key expires by itself)."""

    # KEYS[1]: the key; ARGV: expected token ("" = absent), new value, TTL ms
    _SWAP = """
    local raw = redis.call('GET', KEYS[1])
    local token = ''
    if raw then token = cjson.decode(raw)['token'] end
    if token == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return {1, raw or ''} end
    return {0, raw or ''}
    """
    _DELETE = """
    local raw = redis.call('GET', KEYS[1])
    if raw and cjson.decode(raw)['token'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
    return 0
    """

    def __init__(self, url: str, name: str, ttl_s: float) -> None:
        from megatrain.launch.redis_client import connect

        self.client = connect(url, socket_timeout=5)
        self.key = f"megatrain:lease:{name}"
        self.where = f"{name} (lease {self.key} at {url})"
        self.ttl_ms = int(ttl_s * 1000)

    def swap(self, record: LeaseRecord, allowed: Callable[[LeaseRecord | None], bool]) -> tuple[bool, LeaseRecord | None]:
        """As ``FileLeaseStore.swap``: judged on a read, written only if the key still holds
        what was judged (a script: atomic on the server)."""
        raw = self.client.get(self.key)
        current = LeaseRecord.parse(raw) if raw else None
        if not allowed(current):
            return False, current
        expected = current.token if current is not None else ""
        done, now = self.client.eval(self._SWAP, 1, self.key, expected, json.dumps(asdict(record)), self.ttl_ms)
        if not done:  # changed between our read and the script: someone else won
            return False, LeaseRecord.parse(now) if now else None
        return True, current

    def delete(self, token: str) -> None:
        self.client.eval(self._DELETE, 1, self.key, token)


class Lease:
    """Hold the lease of ``store`` while the ``with`` block runs.

    ``wait_s``: how long to wait for a live holder to let go (0: refuse at once). ``on_lost``:
    called (from the heartbeat thread) if the lease is found taken over by another run. ``log``
    gets the problems (a failed heartbeat, a lost lease); ``log_takeover`` the takeover of a gone
    holder's lease (default ``log``; routine for a rank restarted after a crash).
    """

    def __init__(self, store: FileLeaseStore | RedisLeaseStore, owner: str, *, stale_after_s: float = 60.0,
                 heartbeat_s: float | None = None, wait_s: float = 0.0,
                 on_lost: Callable[[str], None] | None = None, log: Callable[[str], None] = print,
                 log_takeover: Callable[[str], None] | None = None, epoch: int | None = None) -> None:
        self.store = store
        self.record = LeaseRecord(owner=owner, epoch=epoch)
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else stale_after_s / 4
        self.wait_s = wait_s
        self.on_lost = on_lost
        self.log = log
        self.log_takeover = log_takeover or log
        self.lost = False
        self.took_over: LeaseRecord | None = None  # the stale holder this lease replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> Lease:
        deadline = time.monotonic() + self.wait_s
        while True:
            verdict: dict[str, str | None] = {}

            def free_or_stale(current: LeaseRecord | None) -> bool:
                verdict["reason"] = None if current is None else current.stale_reason(self.stale_after_s, self.record.epoch)
                return current is None or verdict["reason"] is not None

            won, before = self.store.swap(self.record, free_or_stale)
            if won:
                if before is not None:
                    self.took_over = before
                    self.log_takeover(f"took over the stale lease of {self.store.where} from {before.owner}: {verdict['reason']}")
                break
            if before is None:  # freed between the read and the write: try again at once
                continue
            if time.monotonic() >= deadline:
                raise LeaseHeld(self.store.where, before)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.record.heartbeat = time.time()
            try:
                # A lease that vanished (a restarted Redis comes back empty, a deleted folder) is
                # written again; only another holder's record means it was taken over.
                ours, current = self.store.swap(self.record, lambda now: now is None or now.token == self.record.token)
            except Exception as exc:  # a store outage: keep trying; the timeout covers the rest
                self.log(f"lease heartbeat of {self.store.where} failed: {exc}")
                continue
            if not ours:
                self.lost = True
                holder = current.describe() if current is not None else "nobody"
                self.log(f"lost the lease of {self.store.where}: now held by {holder}")
                if self.on_lost is not None:
                    self.on_lost(holder)
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.lost:
            self.store.delete(self.record.token)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def lease_store(directory: str | Path, name: str, redis_url: str | None, ttl_s: float) -> FileLeaseStore | RedisLeaseStore:
    """Redis when the campaign has a ``redis_url`` (it spans hosts), else a lock file."""
    return RedisLeaseStore(redis_url, name, ttl_s) if redis_url else FileLeaseStore(directory)
