"""A rendezvous store whose server accepted the connection and never answers (a stopped rank 0,
a wedged proxy): c10d's TCPStore client blocks past its own timeout there. connect_store ends the
wait by its deadline with one line naming the store's address, and the wait shows for the
heartbeat while it lasts (megatrain/waits.py)."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest

from megatrain import waits
from megatrain.config import InitConfig
from megatrain.parallel import rendezvous
from megatrain.parallel.init import connect_store


@pytest.fixture
def silent_server():
    """A TCP listener on loopback that accepts every connection and never sends a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="silent-server")
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_a_tcp_store_that_accepted_and_never_answers_ends_by_its_deadline(silent_server, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(silent_server))
    monkeypatch.setattr(rendezvous.CountingStore, "GRACE_S", 0.5)
    outcome: dict = {}
    seen: list[dict] = []

    def connect() -> None:
        try:
            outcome["store"] = connect_store(InitConfig(store="tcp"), rank=1, world=2, run_id="run", redis_url=None,
                                             timeout=datetime.timedelta(seconds=1))
        except Exception as exc:  # noqa: BLE001  (checked below)
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="connect-store")
    thread.start()
    while thread.is_alive() and not seen:
        seen = [w for w in waits.current() if w["what"] == "rendezvous store: connect"]
        time.sleep(0.01)
    thread.join(60)  # the previous code stayed in TCPStore's constructor (over 60 s measured)
    assert not thread.is_alive(), "connect_store still waits on a server that never answers"
    error = outcome.get("error")
    assert isinstance(error, TimeoutError), outcome
    assert str(error) == (f"no answer from rendezvous store: connect at 127.0.0.1:{silent_server} within 1.5 s "
                          "(the server accepted the connection and did not answer)")
    assert seen and seen[0]["where"] == f"127.0.0.1:{silent_server}"
