"""Can a run write here? Found out before it trains, not at its first checkpoint.

``probe_location(url)`` writes a small uniquely named file under ``url`` (atomically, as
checkpoints are written), reads it back, compares and deletes it - the delete also on failure -
and reports the free space of a local filesystem. ``probe_locations(targets)`` does that for
several locations, then checks that each filesystem has room for what is asked of it: locations
that share one filesystem (a run dir and its staging dir on one disk) must fit there together.

What a failure means decides what the caller may do about it:

- ``LocationNotWritable`` (read-only filesystem, permission denied, bucket or parent missing,
  bytes read back that differ) and ``LocationTooSmall`` (free space below the need) are
  deterministic: the next attempt meets the same disk. Each message is one line naming the
  location, the bytes it must hold and the bytes free.
- Anything else (connection refused, a timeout, a 5xx) is a ``StorageError``, which is not
  deterministic: an outage may end, so the caller's retries still apply.

Knows nothing of configs: the caller names the location (``label``, e.g. a config field) and
says how many bytes it must hold (``needed``) and for what.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
import uuid
from dataclasses import dataclass

from megatrain.errors import DeterministicError
from megatrain.storage.atomic import write_bytes
from megatrain.storage.space import NoSpaceError, free_bytes
from megatrain.storage.urls import StorageError, join_url, local_path, read_bytes, rm

PROBE_PREFIX = ".megatrain-probe-"  # every probe file starts so: a leftover is recognisable
_NOT_WRITABLE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}


def human(n: int | None) -> str:
    """``1234567`` -> ``"1234567 bytes (1.2 MiB)"``: exact for a script, readable for a person."""
    if n is None:
        return "unknown"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{n} bytes ({value:.1f} {unit})" if unit != "B" else f"{n} bytes"


@dataclass(frozen=True)
class Target:
    """A location to probe: ``label`` names it in messages (a config field), ``needed`` bytes of
    free space it must have (checked on local filesystems; 0: none), ``what`` they are for."""

    url: str
    label: str = ""
    needed: int = 0
    what: str = ""

    @property
    def name(self) -> str:
        return f"{self.label} {self.url}" if self.label else self.url


@dataclass(frozen=True)
class ProbeResult:
    url: str
    free: int | None  # bytes free on a local filesystem; None for remote storage
    nbytes: int  # bytes written and read back
    write_s: float
    read_s: float


class LocationNotWritable(DeterministicError):
    """A location a run must write that refuses a write, a read back or a delete."""

    def __init__(self, target: Target, reason: str, free: int | None) -> None:
        need = f"; it must hold {target.what}: {human(target.needed)}" if target.needed else ""
        free_text = f", {human(free)} free" if free is not None else ""
        super().__init__(f"{target.name} is not writable: {reason}{need}{free_text}")
        self.url, self.needed, self.free = target.url, target.needed, free


class LocationTooSmall(NoSpaceError):
    """A local filesystem with less free space than the locations on it must hold (a
    ``NoSpaceError``, so ``storage.is_no_space`` knows it)."""

    def __init__(self, targets: list[Target], needed: int, free: int) -> None:
        names = " and ".join(t.name for t in targets)
        shared = " (one filesystem)" if len(targets) > 1 else ""
        what = " + ".join(t.what for t in targets)
        # NoSpaceError's own message names one path and one purpose: say all of them instead
        DeterministicError.__init__(self, f"{names}{shared}: too small for {what}: needs {human(needed)}, "
                                          f"{human(free)} free")
        self.path, self.needed, self.free = targets[0].url, needed, free


def _not_writable_reason(exc: BaseException) -> str | None:
    """Why ``exc`` (or an error it was raised from) says this location can never take a write,
    or None when it may be an outage that ends."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (PermissionError, FileNotFoundError, NotADirectoryError)) or (
                isinstance(exc, OSError) and exc.errno in _NOT_WRITABLE_ERRNOS):
            text = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno and exc.strerror else str(exc)
            return f"{type(exc).__name__}: {text}"
        exc = exc.__cause__ or exc.__context__
    return None


def _local_dirs(url: str) -> tuple[str, list[str]] | None:
    """For a local ``url``: its nearest existing directory (what holds its files' filesystem) and
    the directories below that do not exist yet, deepest first (the probe removes those it made)."""
    path = local_path(url)
    if path is None:
        return None
    missing, here = [], os.path.abspath(path)
    while not os.path.exists(here) and here != os.path.dirname(here):
        missing.append(here)
        here = os.path.dirname(here)
    return here, missing


def probe_location(target: Target | str, payload_bytes: int = 4096) -> ProbeResult:
    """Write, read back, compare and delete a uniquely named file of ``payload_bytes`` under the
    target; directories it had to create are removed again. Raises ``LocationNotWritable``
    (deterministic) or ``StorageError`` (an outage: retriable); leaves no file behind either way."""
    target = Target(target) if isinstance(target, str) else target
    free = free_bytes(target.url)
    created = (_local_dirs(target.url) or ("", []))[1]
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    url = join_url(target.url, name)
    payload = os.urandom(payload_bytes)
    written = removed = False
    try:
        start = time.perf_counter()
        write_bytes(url, payload)  # local: creates missing directories; object stores have none
        written, wrote = True, time.perf_counter()
        back = read_bytes(url)
        read = time.perf_counter()
        if back != payload:
            raise LocationNotWritable(target, f"{url} read back {len(back)} bytes that differ from the "
                                              f"{len(payload)} written", free)
        rm(url)  # a run's retention deletes too: a store that refuses it fails here, not later
        removed = True
    except StorageError as exc:
        reason = _not_writable_reason(exc)
        if reason is None:
            raise  # an outage: the caller's retries apply, and the message names the URL
        raise LocationNotWritable(target, reason, free) from exc
    finally:
        if written and not removed:  # a failed write published nothing (atomic_write)
            with contextlib.suppress(Exception):  # the primary error is the one to report
                rm(url, missing_ok=True)
        for directory in created:  # deepest first; a directory someone else filled stays
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    return ProbeResult(target.url, free, len(payload), wrote - start, read - wrote)


def check_room(targets: list[Target]) -> None:
    """Raise ``LocationTooSmall`` when a local filesystem has less free space than the targets
    on it need together (remote storage has no meaningful "free": never checked)."""
    by_filesystem: dict[int, list[Target]] = {}
    for target in targets:
        local = _local_dirs(target.url)
        if local is not None and target.needed > 0:
            by_filesystem.setdefault(os.stat(local[0]).st_dev, []).append(target)
    for group in by_filesystem.values():
        needed, free = sum(t.needed for t in group), free_bytes(group[0].url)
        if free is not None and needed > free:
            raise LocationTooSmall(group, needed, free)


def probe_locations(targets: list[Target], payload_bytes: int = 4096) -> list[ProbeResult]:
    """Every target is writable and every local filesystem has room for what its targets need;
    the first failure raises (see ``probe_location`` and ``check_room``)."""
    results = [probe_location(target, payload_bytes) for target in targets]  # a read-only disk says so first
    check_room(targets)
    return results
