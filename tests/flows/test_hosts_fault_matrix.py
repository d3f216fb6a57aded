"""The rest of the 4-host fault matrix through the real ``pretrain`` flow, on one cluster for the whole
campaign (configs/campaign-hosts-faults.yaml: 4 hosts x 1 CPU rank, three short stages, each from the
one before's checkpoint), so the flow's start-up is paid once, not once per fault class:

- partition: node 1 cut off 8 s from step 5; the verdict names its host, address and rank; attempt 2 runs
  on nodes 0, 2, 3 with a newer epoch; every commit's epoch (manifest and rank markers) is read: the first
  attempt's epoch commits no step after the one attempt 2 resumed from (node 1's stale rank is fenced);
- outage: node 1 is back (grow to 4 in the stage's layout); the Redis host down 8 s from step 3 is retried
  through in one attempt: every step trained once, every checkpoint committed, no host called lost;
- hang: rank 1 on node 1 hangs at step 3: the watcher names it hung and the verdict carries the stacks of
  the ranks on their hosts, asked for through Redis (rank 1's shows ``hang_forever``); attempt 2 on all 4;
- slow: node 3's link at 20mbit is named (host, address, link) and evicted by
  reliability.evict_slow_host_after_s through the lost-host path: attempt 2 on nodes 0-2 (shrink).

Per stage the data position of the last checkpoint equals the samples of the steps trained (one global
batch each). Afterwards no namespace, link or process of the campaign's cluster is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from megatrain.launch import hosts

from test_hosts_campaign import _jsonl, _launches, _losses, hosts_campaign_file, run_hosts_campaign

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "campaign-hosts-faults.yaml"
GLOBAL_BATCH = 12

pytestmark = pytest.mark.slow  # ranks in hosts and a Prefect flow: still part of make test


def _commits(durable: Path) -> dict[int, dict]:
    """step -> {"manifest": epoch, "markers": {rank: epoch}} of every committed step."""
    found = {}
    for step_dir in sorted(durable.glob("step-*")):
        if not (step_dir / "manifest.json").exists():
            continue
        markers = {p.name: json.loads(p.read_text()).get("epoch") for p in step_dir.glob("rank-*.done.json")}
        found[int(step_dir.name[5:])] = {"manifest": json.loads((step_dir / "manifest.json").read_text())["epoch"],
                                         "markers": markers}
    return found


def _position(durable: Path, step: int) -> tuple[int, int, int]:
    """(samples consumed in the stage, the data's sample where the stage started, where it stands) at ``step``."""
    loader = json.loads((durable / f"step-{step:08d}" / "rank-00000.json").read_text())["loader"]
    start = loader["start"].get("data", {}).get("samples", 0)
    return loader["samples_consumed"], start, loader["cursors"]["data"]["samples"]


def _committed_at(log: Path, step: int) -> float:
    """When rank 0 logged the commit of ``step`` (its log's UTC timestamp): after any retry it took."""
    for line in log.read_text().splitlines():
        if "committed checkpoint" in line and f"step-{step:08d}" in line:
            stamp = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line).group(1)
            return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
    raise AssertionError(f"{log}: no commit of step {step}")


def _processes_of(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (the campaign's ranks and watches)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.usefixtures("prefect_api")
def test_partition_grow_redis_outage_hang_and_slow_link_in_one_hosts_campaign(shared_dir, shard_url):
    path, before = hosts_campaign_file(CONFIG, shared_dir, shard_url)
    campaign, state, flow_s = run_hosts_campaign(path, before)
    assert _processes_of(shared_dir) == [], "a process of the campaign is still running"

    plans = json.loads((campaign.campaign_dir / "nodes.json").read_text())
    seen = [(r["stage"], r["attempt"], r["nodes"], r["dp"], r["accumulation"], r["change"]) for r in plans]
    assert seen == [
        ("partition", 1, [0, 1, 2, 3], 4, 3, None), ("partition", 2, [0, 2, 3], 3, 4, "shrink"),
        ("outage", 1, [0, 1, 2, 3], 4, 3, "grow"),
        ("hang", 1, [0, 1, 2, 3], 4, 3, None), ("hang", 2, [0, 1, 2, 3], 4, 3, None),
        ("slow", 1, [0, 1, 2, 3], 4, 3, None), ("slow", 2, [0, 1, 2], 3, 4, "shrink")], seen
    launches = asyncio.run(_launches(state.state_details.flow_run_id))
    assert [r.state.type.value for r in launches] == ["FAILED", "COMPLETED", "COMPLETED", "FAILED", "COMPLETED",
                                                      "FAILED", "COMPLETED"], [r.state for r in launches]
    report = []

    # stage partition: node 1 named, fenced, shrink to 0, 2, 3
    run_dir, durable = campaign.stage_dir(0), Path(campaign.stage_durable_url(0))
    node1 = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    assert (node1["node"], node1["host"], node1["ranks"], node1["fault"]) == (1, "node1", [1], "partition"), node1
    assert node1["address"].endswith(".2") and f"host node1 ({node1['address']}) lost" in node1["message"], node1
    assert node1["message"] in launches[0].state.message, launches[0].state.message
    assert [c.split(" ")[0] for c in plans[1]["excluded"]["1"]][0] == "alive", plans[1]["excluded"]
    epochs = _jsonl(run_dir / "epochs.jsonl")
    assert [e["nodes"] for e in epochs] == [[0, 1, 2, 3], [0, 2, 3]] and epochs[1]["epoch"] > epochs[0]["epoch"]
    old, new = epochs[0]["epoch"], epochs[1]["epoch"]
    [restore] = _jsonl(run_dir / "restores.jsonl")
    resumed = restore["step"]
    assert restore["world_size"] == 3 and 2 <= resumed <= 4, restore
    commits = _commits(durable)
    assert sorted(commits) == list(range(2, 11, 2)), sorted(commits)
    for step, epoch in commits.items():  # the fenced attempt's epoch is in no step after the resumed one
        expected = old if step <= resumed else new
        assert epoch["manifest"] == expected and set(epoch["markers"].values()) == {expected}, (step, epoch)
    assert _position(durable, 10) == (10 * GLOBAL_BATCH, 0, 10 * GLOBAL_BATCH)  # none repeated or skipped
    assert sorted(_losses(run_dir)) == list(range(1, 11))
    report.append(f"partition: {node1['message']} {node1['detection_s']:.2f} s after the fault; epoch {old} "
                  f"commits steps <= {resumed}, epoch {new} the rest")

    # stage outage: grow to 4, redis host down retried through, nothing lost
    run_dir, durable = campaign.stage_dir(1), Path(campaign.stage_durable_url(1))
    assert plans[2]["excluded"] == {}, plans[2]
    outage = json.loads((run_dir / "faults" / "redis_host_down.json").read_text())
    assert outage["restored"] - outage["time"] >= 8.0, outage
    assert not (run_dir / "faults" / "host-lost.json").exists()
    assert [r["exit"] for r in _jsonl(run_dir / "host-attempts.jsonl")] == [0]
    steps = [r["step"] for r in _jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9)), steps  # each step once: none redone, none skipped
    assert sorted(_commits(durable)) == [2, 4, 6, 8]
    log = run_dir / "logs" / "attempt-1.log"
    assert "heartbeat publish failed" in log.read_text() and "heartbeat publish recovered" in log.read_text()
    # the steps trained during the outage were committed once the store was back (the fenced commit retries)
    waited = [s for s in (2, 4, 6, 8) if _committed_at(log, s) >= outage["restored"]]
    assert waited, "no commit fell into the outage: the fault tested nothing"
    assert _position(durable, 8) == (8 * GLOBAL_BATCH, 10 * GLOBAL_BATCH, 18 * GLOBAL_BATCH)
    report.append(f"outage: redis host down {outage['restored'] - outage['time']:.1f} s at step 3, 8/8 steps once, "
                  f"commits of steps {waited} retried through it")

    # stage hang: rank 1 hung on node 1, the stacks of its host's process in the verdict, through the store
    run_dir, durable = campaign.stage_dir(2), Path(campaign.stage_durable_url(2))
    verdict = launches[3].state.message
    assert "hung" in verdict and "--- stack of rank 1 ---" in verdict and "hang_forever" in verdict, verdict[-3000:]
    assert "collect its stack there" not in verdict and "no answer to the stack request" not in verdict, verdict
    assert re.search(r"\n\s+1 \w+\s+node1 ", verdict), verdict[:2000]  # its record names the host it runs on
    [restore] = _jsonl(run_dir / "restores.jsonl")
    assert restore["world_size"] == 4 and 1 <= restore["step"] <= 2, restore
    assert _position(durable, 6) == (6 * GLOBAL_BATCH, 18 * GLOBAL_BATCH, 24 * GLOBAL_BATCH)
    assert sorted(_losses(run_dir)) == list(range(1, 7))
    report.append(f"hang: rank 1 on node1 hung at step 3, its stack in the verdict from its host; resumed at step "
                  f"{restore['step']} on 4 hosts")

    # stage slow: node 3's link named and evicted, shrink to 0-2
    run_dir, durable = campaign.stage_dir(3), Path(campaign.stage_durable_url(3))
    named = json.loads((run_dir / "faults" / "slow-link.json").read_text())
    evicted = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    assert (named["host"], named["ranks"]) == ("node3", [3]) and named["address"].endswith(".4"), named
    assert (evicted["cause"], evicted["node"], evicted["fault"]) == ("slow_link", 3, "slow_link"), evicted
    assert f"host node3 ({named['address']}) evicted" in evicted["message"] and evicted["slow_for_s"] >= 3.0, evicted
    assert evicted["message"] in launches[5].state.message, launches[5].state.message
    [restore] = _jsonl(run_dir / "restores.jsonl")
    assert restore["world_size"] == 3, restore
    assert _position(durable, 40) == (40 * GLOBAL_BATCH, 24 * GLOBAL_BATCH, 64 * GLOBAL_BATCH)
    assert sorted(_losses(run_dir)) == list(range(1, 41))
    report.append(f"slow: {named['why']}; {evicted['message']}, resumed at step {restore['step']}")
    print("\n" + "\n".join(report) + f"\nflow {flow_s:.0f} s")
