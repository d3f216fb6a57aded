"""The keeper's peer tier with real processes: two nodes' keepers on one box (different staging
dirs, node ids 0 and 1, a registry folder), each started by a rank process that saves and dies.

Node 1's keeper replicates its rank's copies to node 0's over TCP (and node 0's to node 1's). Then
node 0's own copy of rank 0 is damaged: the next tier is node 1's replica of it. Then node 1 is
lost: its keeper is SIGKILLed. A restarted rank of node 1 finds nothing in its own
keeper and fetches its copy from node 0's replica, bit for bit what it saved; a copy corrupted in
node 0's memory is refused by its checksums, so restore goes on to the durable tier; a process
without the run's token can neither list, fetch nor push copies.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.files import ChecksumError
from megatrain.checkpoint.keeper_peer import Channel, PeerClient, PeerError, Registry
from megatrain.checkpoint.memory import (
    KeeperClient,
    KeeperError,
    MemoryCheckpoints,
    PeerSettings,
    keeper_dir,
    read_newest,
)
from megatrain.launch.run_token import RUN_TOKEN_ENV

PUT = textwrap.dedent("""
    import json, os, signal, sys, torch
    from pathlib import Path
    from megatrain.checkpoint.memory import MemoryCheckpoints, PeerSettings
    from megatrain.checkpoint.snapshot import RankSnapshot
    staging, rank, steps, peer = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], sys.argv[4]
    memory = MemoryCheckpoints(staging, rank=rank, device=torch.device("cpu"), log_path=Path(staging) / "keeper.log",
                               peer=PeerSettings(**json.loads(peer)))
    for step in steps:
        g = torch.Generator().manual_seed(step * 100 + rank)
        tensors = {"w": torch.randn(1000, 700, generator=g), "n": torch.arange(5, dtype=torch.int64) + step,
                   "h": torch.randn(3, generator=g).to(torch.bfloat16), "empty": torch.empty(0)}
        name = f"rank-{rank:05d}"
        assert memory.save(RankSnapshot(step=step, rank=rank, tensor_files={name + ".safetensors": tensors},
                                        json_files={name + ".json": {"step": step, "loader": [step, 7]}}))
    memory.wait()
    os.kill(os.getpid(), signal.SIGKILL)  # the rank dies; its node's keeper lives on
""")


def expected(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(1000, 700, generator=g), "n": torch.arange(5, dtype=torch.int64) + step,
            "h": torch.randn(3, generator=g).to(torch.bfloat16), "empty": torch.empty(0)}


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Two nodes' staging dirs and ring settings; the token and loopback address reach the keepers
    through the environment they inherit."""
    monkeypatch.setenv(RUN_TOKEN_ENV, "token-of-this-run-0123456789abcdef")
    monkeypatch.setenv("MEGATRAIN_KEEPER_HOST", "127.0.0.1")
    registry = str(tmp_path / "keepers")
    stagings = [tmp_path / f"node-{n}" / "staging" for n in (0, 1)]
    settings = [PeerSettings(n, 2, registry, "peer-test") for n in (0, 1)]
    for path in stagings:
        path.mkdir(parents=True)
    yield stagings, settings
    for path in stagings:  # never leave a keeper behind, whatever the test did
        with contextlib.suppress(KeeperError):
            KeeperClient.connect(keeper_dir(path), timeout_s=0).request("shutdown")


def put_and_die(staging: Path, rank: int, steps: str, peer: PeerSettings) -> None:
    proc = subprocess.run([sys.executable, "-c", PUT, str(staging), str(rank), steps, json.dumps(asdict(peer))],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]


def keeper_status(staging: Path) -> dict:
    client = KeeperClient.connect(keeper_dir(staging), timeout_s=5)
    try:
        return client.request("list")[0]
    finally:
        client.close()


def wait_for_replica(staging: Path, rank: int, step: int, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = keeper_status(staging)
        if step in status["peer"]["replicas"].get(str(rank), []):
            return status
        time.sleep(0.05)
    raise AssertionError(f"no replica of rank {rank} step {step} at {staging}: {status}")


@pytest.mark.slow
def test_node_loss_restores_from_the_peer_replica_and_refuses_corruption_and_strangers(nodes):
    (staging0, staging1), (peer0, peer1) = nodes
    put_and_die(staging0, 0, "3,4", peer0)  # node 0's rank 0: its keeper comes up first
    put_and_die(staging1, 2, "3,4", peer1)  # node 1's rank 2

    # Each keeper holds the other node's newest copy (an older one may be superseded before it is sent).
    status0 = wait_for_replica(staging0, rank=2, step=4)
    status1 = wait_for_replica(staging1, rank=0, step=4)
    # Node 1 records what it sent once node 0 has acknowledged it, a moment after node 0 lists the
    # replica: read node 1's record until it is there (it raced a CI run when read once).
    deadline = time.monotonic() + 30
    while status1["peer"]["sent"].get("2", {}).get("step") != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        status1 = keeper_status(staging1)
    sent = status1["peer"]["sent"]["2"]
    assert sent["step"] == 4 and sent["node"] == 0 and sent["bytes"] >= 1000 * 700 * 4, sent
    print(f"replication of a {sent['bytes'] / 1e6:.1f} MB copy: {sent['seconds']:.3f} s")
    assert status0["peer"]["replicas"].get("0") is None  # a node never holds its own ranks as replicas

    # Node 0's own copy of rank 0 damaged in its memory: refused, and the next tier is node 1's
    # replica, not node 0's own keeper again (it also serves its own ranks' copies to peers).
    own = KeeperClient.connect(keeper_dir(staging0), timeout_s=5)
    reply, fds = own.request("get", rank=0, step=4)
    with mmap.mmap(fds[0], reply["nbytes"]) as shared:
        shared[reply["used"] // 2] ^= 0xFF
    os.close(fds[0])
    own.close()
    rank0 = MemoryCheckpoints(staging0, rank=0, device=torch.device("cpu"), log_path=staging0 / "k.log", peer=peer0)
    with pytest.raises(ChecksumError, match="sha256 of chunk"):
        rank0.fetch(4)
    assert rank0.peer_steps()[4] == status1["peer"]["address"]
    got = rank0.fetch(4, status1["peer"]["address"])[0]["rank-00000.safetensors"]
    assert all(torch.equal(got[k], v) for k, v in expected(0, 4).items())
    rank0.close()

    # Node 1 is lost: its keeper dies by SIGKILL (its rank is dead already).
    os.kill(status1["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(status1["pid"], 0)
            time.sleep(0.05)
            continue
        break

    restarted = MemoryCheckpoints(staging1, rank=2, device=torch.device("cpu"), log_path=staging1 / "k.log", peer=peer1)
    assert restarted.held_steps() == []  # its own keeper's copies are gone with it
    held = restarted.peer_steps()
    assert 4 in held and held[4] == status0["peer"]["address"], held
    start = time.perf_counter()
    files, json_files = restarted.fetch(4, held[4])
    print(f"fetch from the peer tier: {time.perf_counter() - start:.3f} s")
    got = files["rank-00002.safetensors"]
    assert got.keys() == expected(2, 4).keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected(2, 4).items())
    assert json_files == {"rank-00002.json": {"step": 4, "loader": [4, 7]}}

    # A stranger (no token, or a wrong one) can neither list, fetch nor push.
    with pytest.raises(PeerError, match="authentication failed"):
        Channel.client(held[4], "not-the-token")
    stranger = PeerClient(Registry(peer1.registry, peer1.run_id), node=1, token="not-the-token")
    assert stranger.held(2) == {}
    with pytest.raises(PeerError):
        stranger.fetch(held[4], 2, 4, lambda n: (buffer := bytearray(n), memoryview(buffer)))
    host, port = held[4].rsplit(":", 1)
    with socket_to(host, int(port)) as raw:  # skips the handshake and pushes a put straight away
        from megatrain.checkpoint.keeper_wire import recv_message, send_message
        recv_message(raw)
        send_message(raw, {"op": "put", "rank": 2, "step": 99, "used": 4, "chunks": [], "entries": [], "json": "{}",
                           "json_sha256": ""})
        assert recv_message(raw)[0] == {"ok": False, "error": "authentication failed: not this run's token"}
    assert 99 not in held_steps_of(staging0, 2)

    # One flipped byte in node 0's replica: refused, and the restore's tiers end in "use durable".
    client = KeeperClient.connect(keeper_dir(staging0), timeout_s=5)
    reply, fds = client.request("get", rank=2, step=4, replica=True)
    with mmap.mmap(fds[0], reply["nbytes"]) as shared:
        shared[reply["used"] // 2] ^= 0xFF
    os.close(fds[0])
    client.close()
    with pytest.raises(ChecksumError, match="peer keeper .* sha256 of chunk"):
        restarted.fetch(4, held[4])
    state, problem = read_newest(restarted, 4, local=[], peer=held, groups=None, identity=None, layout={})
    assert state is None and "sha256 of chunk" in problem, problem
    restarted.close()


def held_steps_of(staging: Path, rank: int) -> list[int]:
    return keeper_status(staging)["peer"]["replicas"].get(str(rank), [])


@contextlib.contextmanager
def socket_to(host: str, port: int):
    import socket
    sock = socket.create_connection((host, port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (apt-get install redis-server)")
def test_registry_in_redis_is_scoped_by_the_run_token(tmp_path, monkeypatch):
    """On a cluster keepers register in the run's Redis: a hash per run, in the token's namespace,
    so another run (another token) sees none of them."""
    import socket as socketlib

    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        monkeypatch.setenv(RUN_TOKEN_ENV, "token-a")
        ours = Registry(url, "run-1")
        deadline = time.monotonic() + 10
        while True:
            try:
                ours.register(1, "10.0.0.2:4001")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                assert time.monotonic() < deadline
                time.sleep(0.05)
        ours.register(0, "10.0.0.1:4000")
        assert ours.addresses() == {0: "10.0.0.1:4000", 1: "10.0.0.2:4001"}
        monkeypatch.setenv(RUN_TOKEN_ENV, "token-b")
        assert Registry(url, "run-1").addresses() == {}
    finally:
        server.terminate()
        server.wait(timeout=10)
