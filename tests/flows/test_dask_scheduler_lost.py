"""A Dask scheduler (``data.dask_address``) that dies in the middle of sharding, or is not there at
all: the shard-corpus flow fails at once in one line naming the scheduler's address, as an
error the flow's retry policy may retry, not as a raw TypeError from a lost task's state."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_shard_dask import SEQ_LEN, VOCAB, _corpus, config

pytestmark = pytest.mark.slow  # a Dask scheduler, a worker and a Prefect flow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def scheduler(tmp_path):
    """A dask scheduler and one worker, as separate processes on loopback."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = str(Path(sys.executable).with_name("dask"))
    log = open(tmp_path / "dask.log", "w")
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
    procs.append(subprocess.Popen([dask, "worker", address, "--nthreads", "1", "--nworkers", "1", "--no-dashboard",
                                   "--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    yield address, procs[0]
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def test_a_scheduler_killed_mid_sharding_is_named(prefect_api, scheduler, tmp_path):
    from flows.shard_data import shard_corpus_on_dask

    address, proc = scheduler
    (tmp_path / "corpus").mkdir()
    corpus = _corpus(tmp_path / "corpus", 480, recursive=True)
    data = {**config(corpus, tmp_path / "shards", "dask"), "dask_address": address}
    outcome: dict = {}

    def shard() -> None:
        try:
            outcome["summary"] = shard_corpus_on_dask(data, SEQ_LEN, VOCAB)
        except BaseException as exc:  # noqa: BLE001  (checked below)
            outcome["error"] = exc

    run = threading.Thread(target=shard, name="shard")
    run.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.is_alive():
        if any(True for _ in (tmp_path / "shards").rglob("shard-*.tar")):  # a unit is under way
            break
        time.sleep(0.05)
    assert run.is_alive(), f"sharding ended before the scheduler was killed: {outcome}"
    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run.join(300)
    assert not run.is_alive(), "the flow still waits on the killed scheduler"
    print(f"failed {time.monotonic() - killed_at:.1f} s after the scheduler was killed: {outcome}")
    error = outcome.get("error")
    assert error is not None, outcome
    assert isinstance(error, ConnectionError) and "\n" not in str(error), repr(error)  # transient: retried
    assert str(error).startswith(f"the Dask scheduler at {address} stopped answering while sharding 1 corpus"), error


def test_a_scheduler_that_is_not_there_is_named_before_anything_runs(tmp_path):
    from flows.shard_data import shard_corpus_on_dask

    address = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens there
    data = {**config(([str(tmp_path / "none.jsonl")], str(tmp_path / "tokenizer.json")), tmp_path / "shards", "dask"),
            "dask_address": address}
    with pytest.raises(ConnectionError) as refused:
        shard_corpus_on_dask(data, SEQ_LEN, VOCAB)
    line = str(refused.value)
    assert line.startswith(f"data.dask_address: the Dask scheduler at {address} does not answer (Connection"), line
    assert "set data.engine=local" in line and "\n" not in line
