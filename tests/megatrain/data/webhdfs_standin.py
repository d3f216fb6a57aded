"""A WebHDFS protocol stand-in for tests: NOT HDFS, just its REST protocol over a temp directory.

No real HDFS can run on the project's machines (no Hadoop in Debian or on PyPI), so the tests
speak to this small server instead. It follows the WebHDFS REST API where our client depends
on it (https://hadoop.apache.org/docs/stable/hadoop-project-dist/hadoop-hdfs/WebHDFS.html):

* CREATE and APPEND answer the namenode request with ``307 Temporary Redirect`` to a "datanode"
  URL (here: the same server with ``datanode=true``), where the body is sent; OPEN redirects too.
* RENAME refuses an existing destination with ``{"boolean": false}`` (no error), as HDFS does.
* Missing paths answer 404 with a ``RemoteException`` of ``FileNotFoundException``.
* Request bodies may use chunked transfer encoding (HdfsCLI sends them that way).

``server.ops`` records (method, op, path, user.name) of every request for assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

PREFIX = "/webhdfs/v1"


class _Handler(BaseHTTPRequestHandler):
    server: WebHDFSStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    # -- plumbing
    def _parse(self) -> tuple[str, dict[str, str], Path]:
        parts = urlsplit(self.path)
        hdfs_path = unquote(parts.path[len(PREFIX):]) or "/"
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return hdfs_path, query, self.server.root / hdfs_path.lstrip("/")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload: bytes = b"", content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, exception: str, message: str) -> None:
        self._json(status, {"RemoteException": {"exception": exception, "javaClassName": f"java.io.{exception}",
                                                "message": message}})

    def _redirect(self, hdfs_path: str, query: dict[str, str]) -> None:
        query = dict(query, datanode="true")
        location = f"http://{self.server.host}:{self.server.port}{PREFIX}{quote(hdfs_path)}?" + "&".join(
            f"{k}={quote(v)}" for k, v in query.items())
        self._send(307, b"", headers={"Location": location})

    @staticmethod
    def _status(path: Path, suffix: str) -> dict:
        stat = path.stat()
        return {"accessTime": int(stat.st_atime * 1000), "blockSize": 134217728, "childrenNum": 0, "fileId": stat.st_ino,
                "group": "supergroup", "length": 0 if path.is_dir() else stat.st_size,
                "modificationTime": int(stat.st_mtime * 1000), "owner": "hdfs", "pathSuffix": suffix,
                "permission": "755" if path.is_dir() else "644", "replication": 0 if path.is_dir() else 3,
                "type": "DIRECTORY" if path.is_dir() else "FILE"}

    def _dispatch(self, method: str) -> None:
        hdfs_path, query, local = self._parse()
        op = query.get("op", "").upper()
        datanode = query.get("datanode") == "true"
        with self.server.lock:
            self.server.ops.append((method, op, hdfs_path, query.get("user.name"), datanode))
        handler = getattr(self, f"_{method}_{op}".lower(), None)
        if handler is None:
            body = self._body() if method in ("PUT", "POST") else b""
            del body
            return self._error(400, "IllegalArgumentException", f"Invalid value for webhdfs parameter op: {op}")
        handler(hdfs_path, query, local, datanode)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- operations
    def _get_getfilestatus(self, hdfs_path, query, local, datanode) -> None:
        if not local.exists():
            return self._error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
        self._json(200, {"FileStatus": self._status(local, "")})

    def _get_liststatus(self, hdfs_path, query, local, datanode) -> None:
        if not local.exists():
            return self._error(404, "FileNotFoundException", f"File {hdfs_path} does not exist.")
        entries = [self._status(p, p.name) for p in sorted(local.iterdir())] if local.is_dir() else [self._status(local, "")]
        self._json(200, {"FileStatuses": {"FileStatus": entries}})

    def _get_open(self, hdfs_path, query, local, datanode) -> None:
        if not local.is_file():
            return self._error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
        if not datanode:
            return self._redirect(hdfs_path, query)
        data = local.read_bytes()
        offset = int(query.get("offset", 0))
        length = int(query["length"]) if "length" in query else len(data) - offset
        self.server.bytes_read += min(length, max(0, len(data) - offset))
        self._send(200, data[offset:offset + length], "application/octet-stream")

    def _put_create(self, hdfs_path, query, local, datanode) -> None:
        if not datanode:
            self._body()
            if local.exists() and query.get("overwrite", "false") != "true":
                return self._error(403, "FileAlreadyExistsException", f"{hdfs_path} already exists")
            return self._redirect(hdfs_path, query)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(self._body())
        self._send(201, b"", headers={"Location": f"hdfs://{self.server.host}:{self.server.port}{hdfs_path}"})

    def _post_append(self, hdfs_path, query, local, datanode) -> None:
        if not local.is_file():
            self._body()
            return self._error(404, "FileNotFoundException", f"File does not exist: {hdfs_path}")
        if not datanode:
            self._body()
            return self._redirect(hdfs_path, query)
        with local.open("ab") as handle:
            handle.write(self._body())
        self._send(200)

    def _put_mkdirs(self, hdfs_path, query, local, datanode) -> None:
        self._body()
        if local.is_file():
            return self._error(403, "FileAlreadyExistsException", f"Parent path is not a directory: {hdfs_path}")
        local.mkdir(parents=True, exist_ok=True)
        self._json(200, {"boolean": True})

    def _put_rename(self, hdfs_path, query, local, datanode) -> None:
        self._body()
        target = self.server.root / unquote(query.get("destination", "")).lstrip("/")
        if not local.exists() or target.exists() or not target.parent.is_dir():
            return self._json(200, {"boolean": False})  # HDFS: no exception, just false
        os.rename(local, target)
        self._json(200, {"boolean": True})

    def _delete_delete(self, hdfs_path, query, local, datanode) -> None:
        if not local.exists():
            return self._json(200, {"boolean": False})
        if local.is_dir():
            if any(local.iterdir()) and query.get("recursive", "false") != "true":
                return self._error(403, "PathIsNotEmptyDirectoryException", f"`{hdfs_path} is non empty': Directory is not empty")
            shutil.rmtree(local)
        else:
            local.unlink()
        self._json(200, {"boolean": True})


class WebHDFSStandIn(ThreadingHTTPServer):
    """Serve the WebHDFS protocol for the files under ``root`` on 127.0.0.1 (a free port)."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root)
        self.host, self.port = "127.0.0.1", self.server_address[1]
        self.ops: list[tuple] = []
        self.bytes_read = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> WebHDFSStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"webhdfs://{self.host}:{self.port}"
