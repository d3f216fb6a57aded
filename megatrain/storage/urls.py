"""URLs to fsspec filesystems, and the reads, listings and deletes on them.

Every failure is a ``StorageError`` whose message starts with the URL (``errors_name``).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem

T = TypeVar("T")


class StorageError(OSError):
    """A storage operation failed; ``str(error)`` names the URL and the underlying reason."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url


def describe(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"


@contextlib.contextmanager
def errors_name(url: str) -> Iterator[None]:
    """Re-raise any failure inside as a StorageError naming ``url`` (the cause stays chained)."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise StorageError(url, f"not found ({describe(exc)})") from exc
    except Exception as exc:  # fsspec backends raise anything: requests, botocore, OSError, ...
        raise StorageError(url, describe(exc)) from exc


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
    with errors_name(url):
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
    with errors_name(url):
        return fs.open(path, mode)


def read_bytes(url: str) -> bytes:
    """The whole file at ``url`` in one read (one GET on object stores and WebHDFS)."""
    fs, path = resolve(url)
    with errors_name(url):
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
        raise StorageError(url, describe(exc)) from exc


def info(url: str) -> dict[str, Any]:
    """fsspec's file details (``size``, ``type`` and whatever the backend adds, e.g. an mtime)."""
    fs, path = resolve(url)
    with errors_name(url):
        return fs.info(path)


def size(url: str) -> int:
    return int(info(url)["size"])


def listdir(url: str) -> list[str]:
    """The URLs of the entries directly inside the directory ``url``, sorted."""
    fs, path = resolve(url)
    with errors_name(url):
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
    with errors_name(url):
        found = fs.find(path, detail=True)
    return {_path_to_url(url, fs, p): d for p, d in sorted(found.items()) if d.get("type") != "directory"}


def glob(pattern: str) -> dict[str, dict[str, Any]]:
    """Files matching a glob URL (``**`` recurses): URL -> info."""
    fs, path = resolve(pattern)
    with errors_name(pattern):
        found = fs.glob(path, detail=True)
    return {_path_to_url(pattern, fs, p): d for p, d in sorted(found.items()) if d.get("type") != "directory"}


def retry_vanished_directory(op: Callable[[], T], attempts: int = 3) -> T:
    """``op()`` (a local makedirs, or an open that makes its directories first), again when it
    raised FileNotFoundError: another process may remove an empty directory of the path between
    its creation and its use. A storage probe cleans up the directories it made (``probe.py``),
    and two campaigns under one new root each probe their own run dir below it (seen once in
    make test). A path that cannot be made fails every attempt alike and raises."""
    for attempt in range(attempts):
        try:
            return op()
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def makedirs(url: str) -> None:
    fs, path = resolve(url)
    with errors_name(url):
        retry_vanished_directory(lambda: fs.makedirs(path, exist_ok=True))


def rm(url: str, recursive: bool = False, missing_ok: bool = False) -> None:
    """Delete a file (or a directory tree with ``recursive=True``); ``missing_ok``: nothing there
    is fine (another process may have deleted it first)."""
    fs, path = resolve(url)
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError as exc:
        if not missing_ok:
            raise StorageError(url, f"not found ({describe(exc)})") from exc
    except Exception as exc:
        raise StorageError(url, describe(exc)) from exc


def join_url(base: str, *parts: str) -> str:
    """``join_url("s3://b/runs", "v1", "index.json") == "s3://b/runs/v1/index.json"``."""
    out = base.rstrip("/") if base not in ("/", "") else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if out and not out.endswith("/") else f"{out}{part}"
    return out


def local_path(url: str) -> str | None:
    """The filesystem path of a local URL (plain path or ``file://``), else None."""
    parts = urlsplit(url)
    if parts.scheme.lower() in ("", "local"):
        return url if not parts.scheme else url.split("://", 1)[1]
    if parts.scheme.lower() == "file":
        return parts.path
    return None


def parent_url(url: str) -> str:
    """The URL of the directory holding ``url``."""
    head, _, _ = url.rstrip("/").rpartition("/")
    return head


def protocols(fs: AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


