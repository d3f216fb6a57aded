"""Files that appear whole or not at all: ``atomic_write``, ``write_bytes``, ``put_file``."""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import IO

from fsspec import AbstractFileSystem

from megatrain.storage.urls import StorageError, errors_name, protocols, resolve, retry_vanished_directory

# Object stores publish an object only when its upload completes, so a direct write is already
# atomic there; a temporary name plus a (copying) rename would only add cost.
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gcs", "gs", "az", "abfs"}


def _commit(fs: AbstractFileSystem, tmp: str, dst: str, url: str) -> None:
    """Move a finished temporary file onto its final name."""
    if "file" in protocols(fs):
        os.replace(tmp, dst)  # POSIX rename: atomic, replaces an existing file
        return
    # HDFS RENAME refuses an existing destination and answers {"boolean": false} instead of an
    # error, which fsspec ignores: delete first, then check that the move really happened.
    if fs.exists(dst):
        fs.rm(dst)
    fs.mv(tmp, dst)
    if fs.exists(tmp) or not fs.exists(dst):
        raise StorageError(url, f"the server refused to rename temporary file {tmp}")


@contextlib.contextmanager
def atomic_write(url: str) -> Iterator[IO[bytes]]:
    """Write a file that appears whole under ``url`` or not at all.

    Local files and HDFS: write ``.<name>.tmp-<uuid>`` beside it, then rename (local rename is
    atomic; on HDFS the delete + rename leaves a short window without the old file, never a
    partial new one). Object stores: write directly, since an upload becomes visible only when it
    completes. If the body raises, nothing is published and an older file stays as it was.
    """
    fs, path = resolve(url)
    local = "file" in protocols(fs)
    direct = bool(protocols(fs) & _ATOMIC_PUT_PROTOCOLS)
    name = f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex[:12]}"
    target = path if direct else posixpath.join(posixpath.dirname(path), name)
    with errors_name(url):
        handle = (retry_vanished_directory(lambda: fs.open(target, "wb")) if local  # auto_mkdir makes its dirs
                  else fs.open(target, "wb"))
    try:
        yield handle  # the caller's own errors pass through unchanged
        with errors_name(url):
            if local:
                handle.flush()
                os.fsync(handle.fileno())  # a crash just after the rename must not leave an empty file
            handle.close()
            if not direct:
                _commit(fs, target, path, url)
    except BaseException:
        if direct:
            # Closing would upload the partial body; discard() aborts it (multipart uploads).
            with contextlib.suppress(Exception):
                getattr(handle, "discard", lambda: None)()
        else:
            with contextlib.suppress(Exception):
                handle.close()
            with contextlib.suppress(Exception):
                fs.rm(target)
        raise


def write_bytes(url: str, data: bytes) -> None:
    """Atomically replace the file at ``url`` with ``data``."""
    with atomic_write(url) as handle:
        handle.write(data)


def put_file(local_path: str, url: str) -> None:
    """Upload a local file to ``url`` atomically (readers never see a partial file)."""
    with errors_name(url), open(local_path, "rb") as src, atomic_write(url) as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)


