"""Fixtures for the reliability tests: a real redis-server on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, process) of a throwaway redis-server: no persistence, loopback only."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    from megatrain.reliability.redis_server import start_redis_server

    port = free_port()
    proc = start_redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    yield url, proc
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(redis_server: tuple[str, subprocess.Popen]) -> str:
    return redis_server[0]


@pytest.fixture
def run_id() -> str:
    """A fresh key namespace per test, so tests sharing the server never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"
