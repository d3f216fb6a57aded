"""Start-up: the three ways to create the layout's groups agree with a single-process reference,
and the start-up faults end in clear errors, not hangs: a rank that never joins, a rank that
joins twice, and a Redis restart in the middle of the rendezvous (which the ranks survive)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.parallel.dims import ParallelDims
from megatrain.reliability.redis_server import start_redis_server

WORKER = Path(__file__).with_name("init_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(rank: int, world: int, port: int, init: dict, modes: str = "", **env) -> subprocess.Popen:
    environ = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", **env}
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        environ.pop(key, None)
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(init), modes], cwd=ROOT, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def redis_url():
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode:
        pytest.fail("redis-server not installed: make services (apt-get install -y redis-server)")
    proc = start_redis_server()
    yield f"redis://127.0.0.1:{proc.port}/0"
    proc.kill()
    proc.wait()


def expected_sums(dims: ParallelDims, rank: int) -> dict[str, float]:
    """The single-process reference: sum of (r + 1) over the members of each of rank's groups."""
    layouts = {"tp_group": dims.tp_groups(), "dp_group": dims.dp_groups(), "pp_group": dims.pp_groups(),
               "stage_group": dims.stage_groups()}
    return {name: float(sum(r + 1 for r in next(g for g in groups if rank in g))) for name, groups in layouts.items()}


@pytest.mark.slow
def test_group_modes_agree_with_reference() -> None:
    """TCPStore here; the Redis store runs the ordered mode in the fault tests below."""
    world, dims = 4, ParallelDims(dp=1, tp=2, pp=2)
    port = free_port()
    init = {"store": "tcp"}
    procs = [launch(r, world, port, init, "default,barrier,ordered", LAYOUT="2,2")
             for r in range(world)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, out[-3000:]
        got = result(out)
        for mode in ("default", "barrier", "ordered"):
            assert got["sums"][mode] == expected_sums(dims, rank), (mode, got)
        # the join barrier: one claim, one arrival per rank
        assert got["store_ops"]["compare_set"] >= 1 and got["store_ops"]["add"] >= 1


@pytest.mark.slow
def test_rank_that_never_joins_is_named(redis_url: str) -> None:
    """World 3, rank 2 never starts: both others fail after the join timeout naming rank 2."""
    port = free_port()
    init = {"store": "redis", "redis_url": redis_url, "join_timeout_s": 3}
    start = time.monotonic()
    procs = [launch(r, 3, port, init, RUN_ID="missing") for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert time.monotonic() - start < 90  # a timeout, not a hang
    for proc, out in zip(procs, outs):
        assert proc.returncode != 0
        assert "RendezvousTimeout: rendezvous timed out after 3 s: 1 of 3 ranks never joined: 2" in out, out[-2000:]


@pytest.mark.slow
def test_missing_ranks_over_tcp_store() -> None:
    """The same with torch's TCPStore: ranks 1-2 missing of 4 named as a range by rank 0, which
    hosts the store; rank 3 names them too, or - when rank 0 gave up first and took the store with
    it - still fails with the rendezvous timeout, not a bare network error."""
    port = free_port()
    procs = [launch(r, 4, port, {"store": "tcp", "join_timeout_s": 3}) for r in (0, 3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(proc.returncode != 0 for proc in procs)
    assert "RendezvousTimeout: rendezvous timed out after 3 s: 2 of 4 ranks never joined: 1-2" in outs[0], outs[0][-2000:]
    assert ("2 of 4 ranks never joined: 1-2" in outs[1]
            or "RendezvousTimeout: rendezvous timed out after 3 s, and the store went away" in outs[1]), outs[1][-2000:]


@pytest.mark.slow
def test_rank_joining_twice_is_refused(redis_url: str) -> None:
    """A second process claiming rank 1 of a running rendezvous fails naming the first; the
    genuine ranks are not disturbed."""
    port = free_port()
    init = {"store": "redis", "redis_url": redis_url, "join_timeout_s": 30}
    first = [launch(r, 2, port, init, "ordered", RUN_ID="twice") for r in range(2)]
    # wait until rank 1 has joined, then start its double
    deadline = time.monotonic() + 120
    for line in first[1].stdout:
        if line.startswith("JOINED") or time.monotonic() > deadline:
            break
    double = launch(1, 2, port, init, "ordered", RUN_ID="twice")
    double_out = double.communicate(timeout=120)[0]
    assert double.returncode != 0
    assert "RankJoinedTwice: rank 1 joined twice: already claimed by" in double_out, double_out[-2000:]
    rest = first[1].communicate(timeout=120)[0]
    out0 = first[0].communicate(timeout=120)[0]
    assert first[0].returncode == 0 and first[1].returncode == 0, out0[-2000:] + rest[-2000:]
    assert result(out0)["sums"]["ordered"]["dp_group"] == 3.0


@pytest.mark.slow
def test_redis_restart_during_rendezvous_is_survived() -> None:
    """Rank 0 joins, Redis restarts (losing every key), rank 1 arrives at the new server: rank 0
    notices the new server, joins again in its namespace, and both finish."""
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode:
        pytest.fail("redis-server not installed: make services (apt-get install -y redis-server)")
    from megatrain.launch.redis_client import connect

    server, port = start_redis_server(), free_port()
    redis_port = server.port  # the restart below takes the same port again
    url = f"redis://127.0.0.1:{redis_port}/0"
    init = {"store": "redis", "redis_url": url, "join_timeout_s": 60}
    rank0 = launch(0, 2, port, init, "ordered", RUN_ID="restart")
    try:
        client = connect(url)  # with the server's password (MEGATRAIN_REDIS_PASSWORD)
        deadline = time.monotonic() + 120
        while not list(client.scan_iter(match="*join/rank0")):
            assert time.monotonic() < deadline and rank0.poll() is None, "rank 0 never joined"
            time.sleep(0.1)
        client.close()
        server.kill()
        server.wait()
        time.sleep(0.5)
        server = start_redis_server(redis_port)
        rank1 = launch(1, 2, port, init, "ordered", RUN_ID="restart")
        out1 = rank1.communicate(timeout=120)[0]
        out0 = rank0.communicate(timeout=120)[0]
    finally:
        rank0.kill()
        server.kill()
        server.wait()
    assert rank0.returncode == 0 and rank1.returncode == 0, out0[-3000:] + out1[-3000:]
    assert "restarted during start-up; joining again" in out0, out0[-3000:]
    assert result(out0)["sums"]["ordered"]["dp_group"] == 3.0
