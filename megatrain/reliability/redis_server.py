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
import subprocess
import time

from megatrain.launch.redis_client import PASSWORD_ENV


def local_password() -> str:
    """The password a local server takes: the environment's, else a new one set there."""
    if not os.environ.get(PASSWORD_ENV):
        os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)
    return os.environ[PASSWORD_ENV]


def start_redis_server(port: int, timeout_s: float = 10.0, password: str | None = None) -> subprocess.Popen:
    """Start ``redis-server`` on 127.0.0.1:``port`` and return it once it answers PING.

    ``password``: default ``local_password()``; the process carries it as ``proc.password``."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not installed (apt-get install -y redis-server)")
    password = password or local_password()
    conf = f"port {port}\nbind 127.0.0.1\nprotected-mode yes\nsave \"\"\nappendonly no\nrequirepass {password}\n"
    proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    proc.stdin.write(conf)
    proc.stdin.close()
    proc.password = password  # type: ignore[attr-defined]
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.02)
    finally:
        client.close()

