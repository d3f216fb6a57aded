"""Free space, checked before a write: a full disk is a deterministic error, found before the
first byte is written rather than halfway through a checkpoint."""

from __future__ import annotations

import errno
import os
import shutil

from megatrain.errors import DeterministicError
from megatrain.storage.urls import local_path


class NoSpaceError(DeterministicError):
    """Not enough free space for a write; names the path, the bytes needed and the bytes free.
    Deterministic: the next attempt would redo the same work and fill the same disk."""

    def __init__(self, path: str, what: str, needed: int, free: int) -> None:
        super().__init__(f"{path}: no space for {what}: needs {needed} bytes, {free} bytes free")
        self.path, self.needed, self.free = path, needed, free


def free_bytes(url: str) -> int | None:
    """Free bytes of the local filesystem holding ``url`` (or its nearest existing parent); None
    for remote storage, which has no meaningful "free"."""
    path = local_path(url)
    if path is None:
        return None
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def check_space(url: str, needed: int, what: str) -> None:
    """Raise NoSpaceError before writing ``needed`` bytes under a local ``url`` that cannot hold
    them (remote storage: no check; its own errors name the URL)."""
    free = free_bytes(url)
    if free is not None and needed > free:
        raise NoSpaceError(url, what, needed, free)


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is the OS saying the disk (or quota) is full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NoSpaceError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


