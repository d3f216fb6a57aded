"""A local filesystem under the ``countfile://`` protocol that logs every file opened for reading.

The node-loader test uses it to prove that only local rank 0 reads storage: each process that
opens a file appends ``<pid> <path>`` to the file named by $MEGATRAIN_TEST_OPEN_LOG. It works
across spawned processes because each one registers the protocol (``register()``) on start.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "countfile"


class CountingFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        log = os.environ.get("MEGATRAIN_TEST_OPEN_LOG")
        if log and "r" in mode:
            with open(log, "a") as handle:
                handle.write(f"{os.getpid()} {self._strip_protocol(path)}\n")
        return super()._open(path, mode, **kwargs)


def register() -> None:
    fsspec.register_implementation(PROTOCOL, CountingFileSystem, clobber=True)


def opens(log_path: str) -> list[tuple[int, str]]:
    """(pid, path) of every logged open."""
    if not os.path.exists(log_path):
        return []
    with open(log_path) as handle:
        return [(int(pid), path) for pid, path in (line.split(" ", 1) for line in handle.read().splitlines())]
