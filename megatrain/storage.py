"""Files by URL: every read and write of shards and checkpoints goes through this module.

A URL is a plain path, ``file://``, ``memory://``, ``s3://bucket/key``, ``webhdfs://host:port/path``
or ``hdfs://host[:port]/path``. ``hdfs://`` is served by fsspec's WebHDFS REST client (the HDFS
HTTP gateway every namenode runs), because fsspec's native ``hdfs://`` needs a JVM and Hadoop jars.

Credentials never live in code or configs; they come from the environment:

=============================  =====================================================================
``MEGATRAIN_S3_ENDPOINT``      S3-compatible endpoint (else ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``);
                               keys and region come from botocore's usual ``AWS_*`` variables/files
``MEGATRAIN_HDFS_USER``        WebHDFS ``user.name`` (else ``HADOOP_USER_NAME``; a ``user@`` in the
                               URL wins)
``MEGATRAIN_HDFS_NAMENODE``    ``host[:port]`` for ``hdfs:///path`` URLs that name no host
``MEGATRAIN_WEBHDFS_PORT``     namenode HTTP port when an ``hdfs://`` URL has none (default 9870)
``MEGATRAIN_WEBHDFS_HTTPS``    ``1`` to speak HTTPS to the namenode
``MEGATRAIN_WEBHDFS_TOKEN``    a Hadoop delegation token (replaces the user name)
=============================  =====================================================================

fsspec's own configuration (``FSSPEC_<PROTOCOL>_<OPTION>`` variables, ``~/.config/fsspec``) applies
too, and explicit ``options`` passed to :func:`resolve` override everything.

Every failure is a :class:`StorageError` whose message starts with the URL, so a bad path in a
config is found from the log line alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import IO, Any
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem

from megatrain.errors import DeterministicError, UnsafePathError

# Object stores publish an object only when its upload completes, so a direct write is already
# atomic there; a temporary name plus a (copying) rename would only add cost.
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gcs", "gs", "az", "abfs"}


class StorageError(OSError):
    """A storage operation failed; ``str(error)`` names the URL and the underlying reason."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url


class NoSpaceError(DeterministicError):
    """Not enough free space for a write; names the path, the bytes needed and the bytes free.
    Deterministic: the next attempt would redo the same work and fill the same disk."""

    def __init__(self, path: str, what: str, needed: int, free: int) -> None:
        super().__init__(f"{path}: no space for {what}: needs {needed} bytes, {free} bytes free")
        self.path, self.needed, self.free = path, needed, free


def free_bytes(url: str) -> int | None:
    """Free bytes of the local filesystem holding ``url`` (or its nearest existing parent); None
    for remote storage, which has no meaningful "free"."""
    path = _local_path(url)
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


def _describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"


@contextlib.contextmanager
def _errors_name(url: str) -> Iterator[None]:
    """Re-raise any failure inside as a StorageError naming ``url`` (the cause stays chained)."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise StorageError(url, f"not found ({_describe(exc)})") from exc
    except Exception as exc:  # fsspec backends raise anything: requests, botocore, OSError, ...
        raise StorageError(url, _describe(exc)) from exc


def _webhdfs_options(parts: Any) -> dict[str, Any]:
    host, port = parts.hostname, parts.port
    if not host:  # hdfs:///path: the namenode comes from the environment
        namenode = os.environ.get("MEGATRAIN_HDFS_NAMENODE", "")
        if not namenode:
            raise ValueError("no namenode host in the URL and MEGATRAIN_HDFS_NAMENODE is not set")
        host, _, env_port = namenode.partition(":")
        port = int(env_port) if env_port else port
    options: dict[str, Any] = {"host": host, "port": port or int(os.environ.get("MEGATRAIN_WEBHDFS_PORT", "9870"))}
    token = os.environ.get("MEGATRAIN_WEBHDFS_TOKEN")
    user = parts.username or os.environ.get("MEGATRAIN_HDFS_USER") or os.environ.get("HADOOP_USER_NAME")
    if token:
        options["token"] = token
    elif user:
        options["user"] = user
    if os.environ.get("MEGATRAIN_WEBHDFS_HTTPS", "") in ("1", "true", "yes"):
        options["use_https"] = True
    return options


def resolve(url: str, options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """URL -> (fsspec filesystem, path inside it), with credentials from the environment.

    fsspec caches filesystem instances by their arguments, so calling this per operation is cheap.
    """
    with _errors_name(url):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        extra: dict[str, Any] = {}
        if scheme in ("hdfs", "webhdfs"):
            # Parse host/port/user ourselves: hdfs:// must reach the WebHDFS class, and the path
            # inside the filesystem is the URL's path alone.
            extra = _webhdfs_options(parts)
            extra.update(options or {})
            fs = fsspec.filesystem("webhdfs", **extra)
            return fs, parts.path or "/"
        if scheme in ("s3", "s3a"):
            endpoint = (os.environ.get("MEGATRAIN_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3")
                        or os.environ.get("AWS_ENDPOINT_URL"))
            if endpoint:
                extra["endpoint_url"] = endpoint
            # Listings cached in one process would hide objects another process (another rank, the
            # checkpoint uploader) has written since: always ask the server.
            extra["use_listings_cache"] = False
        elif scheme in ("", "file", "local"):
            extra["auto_mkdir"] = True  # writing a/b/c.tar creates a/b, as object stores do
        extra.update(options or {})
        fs, path = fsspec.core.url_to_fs(url, **extra)
        return fs, path


def open_url(url: str, mode: str = "rb", options: dict[str, Any] | None = None) -> IO[Any]:
    """Open a file for reading or writing (binary unless ``mode`` says ``t``)."""
    fs, path = resolve(url, options)
    with _errors_name(url):
        return fs.open(path, mode)


def read_bytes(url: str) -> bytes:
    """The whole file at ``url`` in one read (one GET on object stores and WebHDFS)."""
    fs, path = resolve(url)
    with _errors_name(url):
        return fs.cat_file(path)


def exists(url: str) -> bool:
    """Whether ``url`` names a file or directory.

    fsspec's own ``exists`` answers False on *any* error, which would turn an outage of the
    storage service into "no shards yet, write them again": only not-found means False here.
    """
    fs, path = resolve(url)
    try:
        fs.info(path)
        return True
    except FileNotFoundError:
        return False
    except Exception as exc:
        raise StorageError(url, _describe(exc)) from exc


def info(url: str) -> dict[str, Any]:
    """fsspec's file details (``size``, ``type`` and whatever the backend adds, e.g. an mtime)."""
    fs, path = resolve(url)
    with _errors_name(url):
        return fs.info(path)


def size(url: str) -> int:
    return int(info(url)["size"])


def listdir(url: str) -> list[str]:
    """The URLs of the entries directly inside the directory ``url``, sorted."""
    fs, path = resolve(url)
    with _errors_name(url):
        names = fs.ls(path, detail=False)
    # Rebuild URLs from base names: backends return bare paths that lost the host and protocol.
    return sorted(join_url(url, posixpath.basename(str(name).rstrip("/"))) for name in names)


list = listdir  # noqa: A001 - ``storage.list(url)`` reads naturally; no builtin list() below


def _path_to_url(like: str, fs: AbstractFileSystem, path: str) -> str:
    """Turn a backend path found under ``like`` back into a URL of the same form."""
    parts = urlsplit(like)
    scheme = parts.scheme.lower()
    if scheme == "":
        return path  # plain paths stay plain
    if scheme in ("hdfs", "webhdfs"):
        return f"{parts.scheme}://{parts.netloc}{path}"  # the host lives in the URL, not the path
    if scheme == "file":
        return f"file://{path}"
    if scheme == "memory":
        return f"memory://{path.lstrip('/')}"  # memory://x and memory:///x are one file: keep the input's form
    return fs.unstrip_protocol(path)


def find(url: str) -> dict[str, dict[str, Any]]:
    """Every file below directory ``url`` (recursive): URL -> info (size, mtime where known)."""
    fs, path = resolve(url)
    with _errors_name(url):
        found = fs.find(path, detail=True)
    return {_path_to_url(url, fs, p): d for p, d in sorted(found.items()) if d.get("type") != "directory"}


def glob(pattern: str) -> dict[str, dict[str, Any]]:
    """Files matching a glob URL (``**`` recurses): URL -> info."""
    fs, path = resolve(pattern)
    with _errors_name(pattern):
        found = fs.glob(path, detail=True)
    return {_path_to_url(pattern, fs, p): d for p, d in sorted(found.items()) if d.get("type") != "directory"}


def makedirs(url: str) -> None:
    fs, path = resolve(url)
    with _errors_name(url):
        fs.makedirs(path, exist_ok=True)


def rm(url: str, recursive: bool = False, missing_ok: bool = False) -> None:
    """Delete a file (or a directory tree with ``recursive=True``); ``missing_ok``: nothing there
    is fine (another process may have deleted it first)."""
    fs, path = resolve(url)
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError as exc:
        if not missing_ok:
            raise StorageError(url, f"not found ({_describe(exc)})") from exc
    except Exception as exc:
        raise StorageError(url, _describe(exc)) from exc


def put_file(local_path: str, url: str) -> None:
    """Upload a local file to ``url`` atomically (readers never see a partial file)."""
    with _errors_name(url), open(local_path, "rb") as src, atomic_write(url) as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)


def join_url(base: str, *parts: str) -> str:
    """``join_url("s3://b/runs", "v1", "index.json") == "s3://b/runs/v1/index.json"``."""
    out = base.rstrip("/") if base not in ("/", "") else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out and not out.endswith("/") else f"{out}{part}"
    return out


# A name read from metadata is one or more plain segments of ASCII letters, digits, ``.``, ``_``
# and ``-``: no ``..``, no absolute path, no backslash, drive letter, ``~``, control character or
# unicode look-alike (a fullwidth solidus or a one-dot leader is a different file to the OS, but
# not to a person reading the manifest).
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_NAME = 1024  # whole name; each segment <= 255 (NAME_MAX of every filesystem we write to)


def _local_path(url: str) -> str | None:
    """The filesystem path of a local URL (plain path or ``file://``), else None."""
    parts = urlsplit(url)
    if parts.scheme.lower() in ("", "local"):
        return url if not parts.scheme else url.split("://", 1)[1]
    if parts.scheme.lower() == "file":
        return parts.path
    return None


def _name_problem(name: object) -> str | None:
    """Why ``name`` may not be used inside a folder, or None when it may."""
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if len(name) > _MAX_NAME:
        return f"{len(name)} characters long (at most {_MAX_NAME})"
    if name.startswith("/"):
        return "an absolute path"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"has a {segment!r} segment" if segment else "has an empty segment"
        if len(segment) > 255:
            return f"a segment of {len(segment)} characters (at most 255)"
        if not _SEGMENT.match(segment):
            odd = next(c for c in segment if not _SEGMENT.match(c))
            return f"character {odd!r} (U+{ord(odd):04X}) is not allowed (only A-Z a-z 0-9 . _ - and / between parts)"
    return None


def confined(base: str, name: object, source: str) -> str:
    """``join_url(base, name)``, refusing any ``name`` that could leave ``base``.

    Every name read from metadata (a manifest, a staged marker, a shard index) goes through here
    before anything is read or written under it. ``source`` names the metadata file the name came
    from, for the error. On a local filesystem the joined path is also resolved (symlinks
    followed) and must still lie inside ``base`` resolved: a planted symlink cannot lead out.
    Raises UnsafePathError (a deterministic error: no retry reads a different name).
    """
    problem = _name_problem(name)
    if problem is None:
        joined = join_url(base, name)
        local_base, local_joined = _local_path(base), _local_path(joined)
        if local_base is not None and local_joined is not None:
            root = os.path.realpath(local_base)
            real = os.path.realpath(local_joined)
            if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
                problem = f"resolves (through a symlink) to {real}, outside {root}"
        if problem is None:
            return joined
    shown = repr(name) if len(repr(name)) <= 120 else repr(name)[:100] + "...(truncated)"
    raise UnsafePathError(f"unsafe name {shown} in {source}: {problem}; a name read from metadata must stay "
                          f"inside its folder {base}")


def parent_url(url: str) -> str:
    """The URL of the directory holding ``url``."""
    head, _, _ = url.rstrip("/").rpartition("/")
    return head


def _protocols(fs: AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def _commit(fs: AbstractFileSystem, tmp: str, dst: str, url: str) -> None:
    """Move a finished temporary file onto its final name."""
    if "file" in _protocols(fs):
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
    local = "file" in _protocols(fs)
    direct = bool(_protocols(fs) & _ATOMIC_PUT_PROTOCOLS)
    name = f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex[:12]}"
    target = path if direct else posixpath.join(posixpath.dirname(path), name)
    with _errors_name(url):
        handle = fs.open(target, "wb")
    try:
        yield handle  # the caller's own errors pass through unchanged
        with _errors_name(url):
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
