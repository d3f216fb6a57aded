"""Node loss, end to end: two nodes on one box (``megatrain.launch.nodes``: two torchrun agents
meeting through c10d, one rank each, each node with its own staging dir and so its own keeper),
the real trainer, RAM checkpoints every step, a durable one every 4.

Rank 1 is SIGKILLed at the start of step 7 (the kill_rank fault), the launcher stops the other
node, and the test kills the keeper of rank 1's node: that node is gone, ranks and keeper. The
relaunch restores rank 0 from its own keeper and rank 1 from the replica the other node's keeper
holds (tier ``peer``), newer than the durable step 4; with that replica corrupted, from the
durable store. Both end bit for bit where a fault-free two-node run ends.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import step_dir_name
from megatrain.checkpoint.memory import (
    KEEPER_IDLE_ENV,
    KeeperClient,
    KeeperError,
    keeper_dir,
)
from megatrain.launch.run_token import RUN_TOKEN_ENV
from megatrain.observe.jsonl import read_rows

REPO = Path(__file__).resolve().parents[3]
STEPS, INTERVAL, KILL_AT = 8, 4, 7


def stagings(run_dir: Path) -> list[Path]:
    return [run_dir / "nodes" / f"node-{n}" / "staging" for n in (0, 1)]


def launch(run_dir: Path, shard_url: str, kill: bool = False) -> subprocess.Popen:
    overrides = [
        "model.n_layer=1", "model.dropout=0.1", f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}",
        "checkpoint.memory_interval=1", "data.max_source_bytes=300000", f"data.shard_url={shard_url}",
        "train.micro_batch_size=4", "train.log_interval=1000", f"train.run_dir={run_dir}",
        f"checkpoint.durable_url={run_dir}/durable", "data.prefetch_batches=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{
        KEEPER_IDLE_ENV: "120", RUN_TOKEN_ENV: f"token-{run_dir.name}-0123456789", "MEGATRAIN_KEEPER_HOST": "127.0.0.1"})
    env["MEGATRAIN_FAULTS"] = json.dumps([{"kind": "kill_rank", "step": KILL_AT, "rank": 1}]) if kill else ""
    command = [sys.executable, "-m", "megatrain.launch.nodes", "--config", "configs/tiny-cpu.yaml", "--nodes-dir",
               str(run_dir / "nodes"), "--nodes", "0,1", "--nproc-per-node", "1", *overrides]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    with open(Path(proc.args[proc.args.index("--nodes-dir") + 1]).parent / "launches.log", "a") as log:
        log.write(out)  # the whole story of a failure, beside the run (assertions show only the tail)
    return proc.returncode, out


def request(staging: Path, op: str, **fields):
    client = KeeperClient.connect(keeper_dir(staging), timeout_s=5)
    try:
        return client.request(op, **fields)
    finally:
        client.close()


def lose_rank1_node(run_dir: Path, corrupt: bool) -> int:
    """Kill the keeper of rank 1's node once the other node holds its replica (corrupted first
    with ``corrupt``); returns the newest step replicated."""
    lists = {path: request(path, "list")[0] for path in stagings(run_dir)}
    (lost, lost_list), = [(p, s) for p, s in lists.items() if "1" in s["ranks"]]
    survivor, = [p for p in lists if p != lost]
    newest = max(entry["step"] for entry in lost_list["ranks"]["1"])
    deadline = time.monotonic() + 30
    while newest not in request(survivor, "list")[0]["peer"]["replicas"].get("1", []):
        assert time.monotonic() < deadline, f"no replica of rank 1 step {newest}: {request(survivor, 'list')[0]}"
        time.sleep(0.1)
    if corrupt:
        for step in request(survivor, "list")[0]["peer"]["replicas"]["1"]:
            reply, fds = request(survivor, "get", rank=1, step=step, replica=True)
            with mmap.mmap(fds[0], reply["nbytes"]) as shared:
                shared[reply["used"] // 2] ^= 0xFF
            os.close(fds[0])
    os.kill(lost_list["pid"], signal.SIGKILL)
    return newest


def final_state(durable: Path) -> dict:
    step_dir = durable / step_dir_name(STEPS)
    state = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        state.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    for path in sorted(step_dir.glob("rank-?????.json")):
        meta = json.loads(path.read_text())
        meta["rng"] = {k: v for k, v in meta["rng"].items() if k not in ("python", "numpy")}  # OS-seeded: see test_resume
        state[path.name] = meta
    assert state, f"no final checkpoint in {step_dir}"
    return state


@pytest.fixture
def runs(tmp_path):
    names = {name: tmp_path / name for name in ("straight", "peer", "corrupt")}
    yield names
    for run_dir in names.values():  # a failed test must not leave keepers holding memory
        for path in stagings(run_dir):
            with contextlib.suppress(KeeperError):
                KeeperClient.connect(keeper_dir(path), timeout_s=0).request("shutdown")


@pytest.mark.slow
def test_node_loss_restores_from_the_peer_keeper_or_durable_when_corrupt_bit_exact(runs, shard_url):
    first = [launch(runs["straight"], shard_url), launch(runs["peer"], shard_url, kill=True),
             launch(runs["corrupt"], shard_url, kill=True)]
    (code, out), *crashes = [finish(proc) for proc in first]
    assert code == 0, out[-3000:]
    for crash_code, crash_out in crashes:
        assert crash_code != 0 and "injecting fault kill_rank on rank 1 at step 7" in crash_out, crash_out[-3000:]
    replicated = {name: lose_rank1_node(runs[name], corrupt=name == "corrupt") for name in ("peer", "corrupt")}
    durable = {name: [i.step for i in catalog.committed(str(runs[name] / "durable"))] for name in ("peer", "corrupt")}

    second = [launch(runs["peer"], shard_url), launch(runs["corrupt"], shard_url)]
    results = [finish(proc) for proc in second]
    for code, out in results:
        assert code == 0, out[-3000:]
    peer_row, = read_rows(runs["peer"] / "restores.jsonl")
    assert peer_row["tier"] == "peer" and peer_row["step"] in (5, 6) and peer_row["step"] <= replicated["peer"], \
        (peer_row, replicated)
    assert peer_row["durable_step"] == max(durable["peer"], default=0)
    print(f"restore from the peer tier: {peer_row['seconds']:.3f} s (step {peer_row['step']})")
    assert "from the peer tier" in results[0][1]
    assert "rejected" in results[1][1] and "sha256 of chunk" in results[1][1]
    if durable["corrupt"] == [INTERVAL]:  # the durable tier, never the corrupt replica
        corrupt_row, = read_rows(runs["corrupt"] / "restores.jsonl")
        assert corrupt_row["tier"] == "durable" and corrupt_row["step"] == INTERVAL, corrupt_row
    else:  # nothing durable yet (step 4's upload lost to the crash): a start from scratch
        assert durable["corrupt"] == [] and not (runs["corrupt"] / "restores.jsonl").exists()

    # Replication ran in the keepers, after each seal: the fault-free run's log says what each cost.
    seconds = sorted(float(m.group(1)) for m in re.finditer(r"replicated rank \d+ step \d+ \(\d+ bytes\) to node \d+ "
                                                             r"in ([0-9.]+) s", (runs["straight"] / "logs" / "keeper.log")
                                                             .read_text()))
    assert seconds, "no replication in the fault-free run's keeper log"
    print(f"replication per snapshot: median {seconds[len(seconds) // 2]:.4f} s, max {seconds[-1]:.4f} s "
          f"({len(seconds)} copies)")

    expected = final_state(runs["straight"] / "durable")
    for name in ("peer", "corrupt"):
        actual = final_state(runs[name] / "durable")
        assert expected.keys() == actual.keys()
        different = [k for k in expected if not (torch.equal(expected[k], actual[k]) if torch.is_tensor(expected[k])
                                                 else expected[k] == actual[k])]
        assert not different, f"{name}: differ after resume: {different}"
