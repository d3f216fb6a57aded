"""A throwaway local redis-server (loopback, no persistence): for tests, the chaos benchmark and
one-machine runs that want the Redis heartbeat sink."""

from __future__ import annotations

import shutil
import subprocess
import time


def start_redis_server(port: int, timeout_s: float = 10.0) -> subprocess.Popen:
    """Start ``redis-server`` on 127.0.0.1:``port`` and return it once it answers PING."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not installed (apt-get install -y redis-server)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
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
