"""Fault-matrix rows of the checkpoint keeper (issue 29), through the real ``pretrain`` flow: a real
Prefect server, torchrun ranks over gloo, the real data pipeline, RAM checkpoints every
``MEMORY_INTERVAL`` steps into the nodes' keepers (started and stopped by the flow), durable ones
every ``INTERVAL``.

To stay cheap, several faults are stages of one attempt history: one stage, a fault every 4 steps,
each restart's tier read from the stage's ``restores.jsonl`` (a row per restore, in order).

- one node, 2 ranks:
  (a) rank 1 SIGKILLed at step 8 -> the local keeper's step 6 (newer than durable step 4; the
      steps redone stay under the memory interval);
  (c) the keeper SIGKILLed, then rank 1, at step 12 -> the durable step 8;
  (d) rank 1's keeper copies corrupted, then rank 1 killed, at step 16 -> checksums fail, the
      durable step 12 (the next tier on one node).
- two nodes on this box (``megatrain.launch.nodes``), 1 rank each, keepers replicating to each other:
  (b) node loss at step 8: rank 1's node loses its keeper and its rank -> rank 1's step 6 from the
      other node's replica (tier ``peer``). (A corrupt own copy with the peer's replica as the next
      tier is test_keeper_peer.py's, at the engine level: here it would cost a third two-node launch.)

Every campaign ends bit for bit where the fault-free one-node campaign ends (one reference for the
module: two nodes of one rank compute what one node of two ranks does), no keeper process outlives
its flow, and the campaign report has a line per restore with its tier and seconds. Every socket
the campaigns' processes listen on binds loopback (sampled from /proc/<pid>/fd and
/proc/<pid>/net/tcp*: the rank 0 store, torchrun's agent stores, the keepers' peer ports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fault_matrix_common import (  # noqa: F401  (fixtures are found by name; reproducible_cpu_math: autouse)
    ROOT, assert_bit_exact, logs, reproducible_cpu_math, run_campaign, workdir,
)
from listening_sockets import ListeningSockets
from process_table import processes_mentioning

from megatrain.checkpoint import catalog
from megatrain.checkpoint.keeper_control import keeper_dir
from megatrain.config import FaultConfig
from megatrain.observe.jsonl import read_rows
from megatrain.reliability.faults import fault_key

STEPS, INTERVAL, MEMORY_INTERVAL = 16, 4, 2
COMMITTED = [8, 12, 16]  # the default keep_last=3


def kill(step: int) -> dict:
    return {"kind": "kill_rank", "step": step, "rank": 1}


def keeper_fault(kind: str, step: int) -> dict:
    return {"kind": kind, "step": step, "rank": 1}


def write_campaign(directory: Path, campaign_id: str, shard_url: Path, nnodes: int = 1,
                   faults: list[dict] | None = None) -> Path:
    """One stage of STEPS steps of the tiny recipe at one layer, 2 ranks (on 1 or 2 nodes). A
    one-node stage with faults keeps a warm standby (its restarts skip the imports: cheaper);
    the math is the same either way."""
    stage = ["reliability.faults=" + json.dumps(faults)] if faults else []
    if faults and nnodes == 1:
        stage.append("reliability.warm_standby=true")
    doc = {
        "id": campaign_id, "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 2 // nnodes,
        "nnodes": nnodes, "root_dir": str(directory / "campaigns"), "shard_url": str(shard_url),
        "self_check": False, "samples": 0, "export": False,
        "overrides": ["model.n_layer=1", "model.dropout=0.1", "data.max_source_bytes=400000",
                      "train.micro_batch_size=4", f"checkpoint.interval={INTERVAL}",
                      f"checkpoint.memory_interval={MEMORY_INTERVAL}", "train.log_interval=1",
                      "reliability.heartbeat_interval_s=0.5", "reliability.heartbeat_timeout_s=60"],
        "stages": [{"name": "only", "steps": STEPS, "overrides": stage}],
    }
    path = directory / f"{campaign_id}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def keeper_folders(outcome, nnodes: int) -> list[Path]:
    stagings = [outcome.run_dir / "staging"] if nnodes == 1 else \
        [outcome.run_dir / "nodes" / f"node-{n}" / "staging" for n in range(nnodes)]
    return [keeper_dir(staging) for staging in stagings]


def assert_no_keeper_left(outcome, nnodes: int) -> None:
    """No keeper process of the campaign is alive after its flow (the flow's or one a rank started)."""
    for folder in keeper_folders(outcome, nnodes):
        alive = [pid for pid in processes_mentioning(f"--dir {folder}")
                 if "megatrain.checkpoint.keeper" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="ignore")]
        assert not alive, f"keeper processes {alive} of {folder} outlived the flow"


def restores(outcome) -> list[dict]:
    rows = read_rows(outcome.run_dir / "restores.jsonl")
    print("\n" + "\n".join(f"restore: {outcome.path.stem} step {r['step']} from {r['tier']} in {r['seconds']:.3f} s "
                           f"(durable {r['durable_step']})" for r in rows))
    return rows


def recovery_s(outcome, logs, fault: dict, row: dict) -> float:
    """Seconds from the kill (its marker file, written just before it fires) to the first step
    after the restore finished (its log record): the restart, the restore and one step."""
    marker = outcome.run_dir / "faults" / f"fired-kill_rank-{fault_key(FaultConfig(**fault))}.json"
    t_fault = marker.stat().st_mtime
    # after the restore's own line: the killed attempt's last step line may reach the log after the kill
    t_restored, _ = logs.need(rf"restored step {row['step']} from the {row['tier']} tier", after=t_fault)
    t_step, _ = logs.need(rf"\bstep {row['step'] + 1}/{STEPS}\b", after=t_restored)
    print(f"recovery, {row['tier']} tier: kill at step {fault['step']} -> step {row['step'] + 1} finished in "
          f"{t_step - t_fault:.2f} s (restore {row['seconds']:.3f} s)")
    return t_step - t_fault


def assert_reported(outcome, rows: list[dict]) -> None:
    """The campaign report has the stage's restores, a line each with its tier and cost."""
    report = Path(outcome.report["report"]).read_text()
    for row in rows:
        assert f"* `only` restored step {row['step']} from the **{row['tier']}** tier in {row['seconds']:.3f} s" \
            in report, report


def assert_listening_on_loopback(sampled: ListeningSockets, *servers: str) -> None:
    """Every socket the campaign's processes listened on (the flow, its Prefect server, ranks,
    torchrun agents, keepers) bound 127.0.0.1 or ::1, and each of ``servers`` (a command-line
    marker) was seen listening: the check saw the sockets it is about."""
    assert not sampled.exposed(), "listening beyond loopback:\n" + "\n".join(sampled.exposed())
    for marker in servers:
        assert sampled.of(marker), f"no listener of a {marker} process seen; all: {sorted(map(str, sampled.seen))}"


@pytest.fixture(scope="module")
def reference(prefect_api, workdir, shard_root) -> str:
    """The fault-free campaign's durable URL (one node, 2 ranks): the rows are compared with it.
    Its sockets, sampled from /proc while it runs, listen on loopback only (rank 0 hosts the store)."""
    with ListeningSockets() as sampled:
        outcome = run_campaign(write_campaign(workdir, "keeper-reference", shard_root))
    assert_listening_on_loopback(sampled, "megatrain.train")
    assert outcome.stage["attempts"] == 1 and not (outcome.run_dir / "restores.jsonl").exists()
    assert [i.step for i in catalog.committed(outcome.durable)] == COMMITTED
    assert_no_keeper_left(outcome, 1)
    return outcome.durable


@pytest.mark.slow
def test_one_node_keeper_then_durable_after_a_lost_or_corrupt_keeper(reference, workdir, shard_root, logs):
    faults = [kill(8),  # (a)
              keeper_fault("kill_keeper", 12), kill(12),  # (c): fired in list order, the keeper first
              keeper_fault("corrupt_keeper", 16), kill(16)]  # (d)
    outcome = run_campaign(write_campaign(workdir, "keeper-one-node", shard_root, faults=faults))
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (4, 3)
    logs.need(r"stage only: checkpoint keepers started")
    (a, c, d) = rows = restores(outcome)
    assert (a["tier"], a["step"], a["durable_step"]) == ("keeper", 6, 4), a
    assert 8 - 1 - a["step"] < MEMORY_INTERVAL  # redone steps: step 7 only
    assert (c["tier"], c["step"]) == ("durable", 8), c  # the keeper's step 10 died with it
    logs.need(r"fault kill_keeper: killed the checkpoint keeper")
    assert (d["tier"], d["step"]) == ("durable", 12), d  # step 14's copy in the keeper failed its checksums
    logs.need(r"keeper copies of step 14 rejected: .*sha256 of chunk")
    for fault, row in zip((faults[0], faults[2], faults[4]), rows):
        recovery_s(outcome, logs, fault, row)
    assert_bit_exact(outcome.durable, reference, COMMITTED)
    assert_reported(outcome, rows)
    assert_no_keeper_left(outcome, 1)


@pytest.mark.slow
def test_two_nodes_node_loss_restores_from_the_peer(reference, workdir, shard_root, logs):
    faults = [keeper_fault("kill_keeper", 8), kill(8)]  # (b) rank 1's node: keeper and rank gone
    with ListeningSockets() as sampled:  # node 0's agent hosts the rendezvous; each keeper a peer port
        outcome = run_campaign(write_campaign(workdir, "keeper-two-nodes", shard_root, nnodes=2, faults=faults))
    assert_listening_on_loopback(sampled, "megatrain.launch.torchrun", "megatrain.checkpoint.keeper")
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    logs.need(r"fault kill_keeper: killed the checkpoint keeper")
    (b,) = rows = restores(outcome)
    assert (b["tier"], b["step"]) == ("peer", 6) and b["durable_step"] in (0, 4), b  # 4: unless its upload lost the race
    assert 8 - 1 - b["step"] < MEMORY_INTERVAL  # a lost node redoes no more than a rank's crash
    recovery_s(outcome, logs, faults[1], b)
    assert_bit_exact(outcome.durable, reference, COMMITTED)
    assert_reported(outcome, rows)
    assert_no_keeper_left(outcome, 2)
