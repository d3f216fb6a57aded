"""A throwaway local redis-server (loopback, no persistence, a password): for tests, the chaos
benchmark and one-machine runs that want the Redis heartbeat sink.

It is locked like the cluster's: it listens on 127.0.0.1 only and requires a password. The
password is ``MEGATRAIN_REDIS_PASSWORD`` when the environment has one, else a new random one that
is put into this process's environment, so that its clients (``megatrain.launch.redis_client``)
and every rank or watcher it starts use it. The configuration goes in on stdin (``redis-server -``):
a ``--requirepass`` argument would show the password to anyone who lists the host's processes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time

from megatrain.launch.redis_client import PASSWORD_ENV


def local_password() -> str:
    """The password a local server takes: the environment's, else a new one set there."""
    if not os.environ.get(PASSWORD_ENV):
        os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)
    return os.environ[PASSWORD_ENV]


def start_redis_server(port: int = 0, timeout_s: float = 10.0, password: str | None = None,
                       attempts: int = 5) -> subprocess.Popen:
    """Start ``redis-server`` on 127.0.0.1:``port`` and return it once it answers PING.

    ``port`` 0: a free port, found by binding one; another process can take it before the server
    binds it (a busy machine), so a server that exits at once is started again on a new one, up to
    ``attempts`` times. ``proc.port`` is the port; ``password``: default ``local_password()``, the
    process carries it as ``proc.password``."""
    if shutil.which("redis-server") is None:
        raise FileNotFoundError("redis-server not installed (apt-get install -y redis-server)")
    password = password or local_password()
    for _ in range(1 if port else attempts):
        try:
            return _start(port or _free_port(), timeout_s, password)
        except _PortTaken:
            continue
    raise RuntimeError(f"redis-server did not start on port {port or 'any free one'}: it exited at once "
                       "(the port in use?)")


class _PortTaken(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(port: int, timeout_s: float, password: str) -> subprocess.Popen:
    import redis

    conf = f"port {port}\nbind 127.0.0.1\nprotected-mode yes\nsave \"\"\nappendonly no\nrequirepass {password}\n"
    proc = subprocess.Popen([shutil.which("redis-server"), "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    proc.stdin.write(conf)
    proc.stdin.close()
    proc.password, proc.port = password, port  # type: ignore[attr-defined]
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return proc
            except (redis.ConnectionError, redis.TimeoutError):  # timeout: another server holds the port
                if proc.poll() is not None:
                    raise _PortTaken() from None
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait(timeout=10)  # killed: reaped at once
                    raise RuntimeError(f"redis-server did not answer on port {port} in {timeout_s:.0f} s") from None
                time.sleep(0.02)
    finally:
        client.close()
