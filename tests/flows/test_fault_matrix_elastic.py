"""Fault-matrix rows of elastic training, through the real ``pretrain`` flow (real Prefect server,
torchrun ranks, gloo, the real data pipeline).

- ``config_mismatch``: a campaign rerun with a model-changing override finds the stage's committed
  checkpoint written by the other model. The restore is refused in the rank (CheckpointMismatch,
  a deterministic error): the stage ends at once, 0 restarts, and the differing field with its
  old and new value is the message of the flow run's and the train-stage task run's Prefect state.
- ``evict_node``: 2 nodes x 2 ranks (two torchrun agents meeting through c10d on loopback). At
  step 5 of stage ``a`` node 1 is killed and then fails its self-check; with
  ``reliability.on_node_loss: shrink`` the stage goes on on node 0 alone (dp 4 -> 2, accumulation
  1 -> 2, same global batch), restored from the last committed checkpoint, resharded. Stage ``b``
  self-checks both nodes again, node 1 passes, and it runs on both (grow), starting from stage
  ``a``'s final checkpoint written at dp 2.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml

from megatrain.config.campaign import load_campaign
from megatrain.checkpoint import catalog

STAGE = """\
- name: only
  steps: 4
  overrides: [{extra}]
"""

pytestmark = pytest.mark.slow  # torchrun ranks (and Prefect flows): still part of make test


async def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


async def _artifact(key: str):
    """The newest version of the artifact under ``key``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    async with get_client() as client:
        found = await client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])))
    return found[0] if found else None


async def _elastic_events(campaign_id: str) -> list[dict]:
    """Payloads of the megatrain.elastic.* events the server has stored for campaign ``campaign_id``
    (the server is the test run's: other campaigns' shrinks and grows are there too)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    resource = EventResourceFilter(id=[f"megatrain.config.campaign.{campaign_id}"])
    async with get_client() as client:
        page = await client.read_events(filter=EventFilter(event=EventNameFilter(prefix=["megatrain.elastic."]),
                                                           resource=resource), limit=50)
    return [{"event": e.event, **e.payload} for e in page.events]


def _wait_for_events(campaign_id: str, names: set[str], timeout_s: float = 30.0) -> list[dict]:
    """Events reach the server asynchronously (the client's websocket): poll until they are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = asyncio.run(_elastic_events(campaign_id))
        if names <= {e["event"] for e in events} or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


@pytest.mark.usefixtures("prefect_api")
def test_config_mismatch_ends_the_stage_at_once(campaign_file):
    from flows.pretrain import pretrain

    first = campaign_file("mismatch", STAGE.format(extra=""))
    assert pretrain(str(first), return_state=True).is_completed()
    durable = load_campaign(first).stage_durable_url(0)
    assert [info.step for info in catalog.committed(durable)] == [2, 4]

    # the same campaign (same stage, same durable URL) with two layers instead of one
    changed = campaign_file("mismatch", STAGE.format(extra="model.n_layer=2"))
    state = pretrain(str(changed), return_state=True)
    assert state.is_failed(), state
    assert "model.n_layer: 1 -> 2" in state.message and "CheckpointMismatch" in state.message, state.message

    runs = asyncio.run(_task_runs(state.state_details.flow_run_id))
    launches = [r for r in runs if r.name.startswith("launch-ranks")]
    stages = [r for r in runs if r.name.startswith("train-stage")]
    assert len(launches) == 1, [r.name for r in launches]  # one attempt: no restart used
    assert len(stages) == 1 and stages[0].state.is_failed()
    assert "model.n_layer: 1 -> 2" in stages[0].state.message, stages[0].state.message
    assert [info.step for info in catalog.committed(durable)] == [2, 4]  # the checkpoint is untouched
    print(f"\nconfig_mismatch: 1 attempt, 0 restarts; flow state: {state.message[:300]}")


ROOT = Path(__file__).resolve().parents[2]


def nodes_campaign(tmp_path: Path, shard_root: Path) -> Path:
    """2 nodes x 2 ranks, policy shrink; stage a kills node 1 at step 5, stage b follows."""
    doc = {
        "id": "evict", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 2, "nnodes": 2,
        "root_dir": str(tmp_path / "campaigns"), "shard_url": str(shard_root), "self_check": True,
        "overrides": [
            "model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2", "data.prefetch_batches=0",
            "train.micro_batch_size=2", "train.global_batch_size=8", "parallel.node_loader=true",
            "reliability.on_node_loss=shrink", "reliability.heartbeat_interval_s=0.5",
            # a lean self-check per node: no all-reduce processes, small GEMM/copy/storage probes
            "reliability.selfcheck.nproc_per_node=1", "reliability.selfcheck.gemm_size=256",
            "reliability.selfcheck.copy_mb=8", "reliability.selfcheck.storage_mb=1",
        ],
        "stages": [
            {"name": "a", "steps": 8, "overrides": ["reliability.faults=[{kind: evict_node, step: 5, node: 1}]"]},
            {"name": "b", "steps": 4},
        ],
    }
    path = tmp_path / "evict.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _steps(run_dir: str) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("prefect_api")
def test_evict_node_shrinks_then_grows_back(tmp_path, shard_root):
    from flows.pretrain import pretrain

    path = nodes_campaign(tmp_path, shard_root)
    campaign = load_campaign(path)
    state = pretrain(str(path), return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    rows = {row["stage"]: row for row in report["stages"]}
    assert rows["a"]["restarts"] == 1 and rows["b"]["restarts"] == 0, rows

    nodes = json.loads((campaign.campaign_dir / "nodes.json").read_text())
    seen = [(r["stage"], r["attempt"], r["nodes"], r["dp"], r["accumulation"], r["change"]) for r in nodes]
    assert seen == [("a", 1, [0, 1], 4, 1, None), ("a", 2, [0], 2, 2, "shrink"), ("b", 1, [0, 1], 4, 1, "grow")], seen
    assert "alive" in nodes[1]["excluded"]["1"][0]
    for node in (0, 1):  # each node staged into its own directory
        assert (campaign.stage_dir(0) / "nodes" / f"node-{node}" / "staging").is_dir()
    artifact = asyncio.run(_artifact("evict-nodes"))
    assert artifact is not None and "shrink" in str(artifact.data) and "grow" in str(artifact.data)
    report_md = Path(report["report"]).read_text()  # the campaign report says what happened to the nodes
    assert "dp 2, accumulation 2 (shrink); node 1 excluded" in report_md and "dp 4, accumulation 1 (grow)" in report_md
    events = _wait_for_events(campaign.id, {"megatrain.elastic.shrink", "megatrain.elastic.grow"})
    changes = sorted((e["event"], e["stage"], e["nodes"]) for e in events)
    assert changes == [("megatrain.elastic.grow", "b", [0, 1]), ("megatrain.elastic.shrink", "a", [0])], events

    a_durable, b_durable = campaign.stage_durable_url(0), campaign.stage_durable_url(1)
    a_final = catalog.committed(a_durable)[-1]
    b_final = catalog.committed(b_durable)[-1]
    assert a_final.step == 8 and a_final.manifest["layout"]["world_size"] == 2 and a_final.manifest["layout"]["dp"] == 2
    assert b_final.step == 4 and b_final.manifest["layout"]["world_size"] == 4 and b_final.manifest["layout"]["dp"] == 4
    # stage a: steps 1..5 on both nodes (killed at 5), then node 0 alone from the last checkpoint
    # committed by then (resharded from 4 ranks to 2, recorded in the checkpoint history) to 8
    meta = json.loads((Path(a_final.url) / "rank-00000.json").read_text())
    [switch] = meta["history"]
    assert switch["layout"][0]["world_size"] == 4 and switch["layout"][1]["world_size"] == 2, switch
    steps = _steps(campaign.stage_dir(0))
    redone = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    # node 0 may commit a step past the kill before it notices: then nothing is redone
    resumed_at = redone[-1] if redone else steps.index(switch["step"]) + 1
    assert steps[resumed_at - 1] >= 5 and steps[resumed_at] == switch["step"] + 1 and steps[-1] == 8, steps
    assert meta["loader"]["samples_consumed"] == 8 * 8  # one global batch per step, none repeated or skipped
    print(f"\nevict_node: {seen}")


def test_node_loss_policy_wait_refuses_and_shrink_goes_on(tmp_path, shard_root):
    """The policy alone (no ranks): node 1 marked evicted fails its check; ``wait`` names it
    after node_wait_s, ``shrink`` plans node 0 with twice the accumulation."""
    from megatrain.launch.nodes import evicted_marker
    from tasks.elastic import NodeLost, plan_nodes

    doc = yaml.safe_load(nodes_campaign(tmp_path, shard_root).read_text())
    doc["self_check"] = False
    doc["overrides"] = [o for o in doc["overrides"] if not o.startswith("reliability.on_node_loss")]
    doc["overrides"] += ["reliability.on_node_loss=wait", "reliability.node_wait_s=0.5"]
    path = tmp_path / "wait.yaml"
    path.write_text(yaml.safe_dump(doc))
    campaign = load_campaign(path)
    from megatrain.config.campaign import stage_config
    from megatrain.launch.ranks import write_run_config

    config_path = str(write_run_config(stage_config(campaign, 0), campaign.stage_dir(0) / "config.yaml"))
    assert plan_nodes(campaign, 0, config_path).nodes == [0, 1]
    marker = evicted_marker(stage_config(campaign, 0).train.run_dir, 1)
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    with pytest.raises(NodeLost, match=r"node 1: alive .*on_node_loss=wait"):
        plan_nodes(campaign, 0, config_path)
    shrink = load_campaign(path, ["overrides=" + json.dumps([*doc["overrides"][:-2], "reliability.on_node_loss=shrink"])])
    plan = plan_nodes(shrink, 0, config_path)
    assert (plan.nodes, plan.world_size, plan.dp, plan.accumulation) == ([0], 2, 2, 2)
    assert list(plan.excluded) == [1]


@pytest.mark.usefixtures("prefect_api")
def test_a_stop_request_stops_every_nodes_ranks_within_seconds(tmp_path, shard_root):
    """``launch-nodes`` polls the same stop signal as ``launch-ranks``: once the stage gives up
    (or the flow is stopped), the ranks of every node are gone within seconds, and the attempt
    ends Cancelled, not as a crash to restart."""
    import threading

    from megatrain.config.campaign import stage_config
    from megatrain.launch.ranks import write_run_config
    from tasks import attempts
    from tasks.elastic import launch_nodes
    from process_table import processes_mentioning

    doc = yaml.safe_load(nodes_campaign(tmp_path, shard_root).read_text())
    doc.update(nproc_per_node=1, self_check=False)
    doc["stages"] = [{"name": "a", "steps": 8,
                      "overrides": ["reliability.faults=[{kind: slow_rank, step: 1, slowdown: 15}]"]}]
    path = tmp_path / "stop.yaml"
    path.write_text(yaml.safe_dump(doc))
    campaign = load_campaign(path)
    config_path = str(write_run_config(stage_config(campaign, 0), campaign.stage_dir(0) / "config.yaml"))
    attempts.ABANDONED[config_path] = threading.Event()
    ended = {}
    launch = threading.Thread(target=lambda: ended.update(state=launch_nodes.fn(campaign, 0, config_path, 1)))
    launch.start()
    try:
        deadline = time.monotonic() + 300
        while not (campaign.stage_dir(0) / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_mentioning(config_path), "the ranks never started"
        attempts.ABANDONED[config_path].set()  # what the stage does when it gives up; STOP is the same path
        stopped_at = time.monotonic()
        launch.join(60)
        gone = time.monotonic()
        while processes_mentioning(config_path) and time.monotonic() - gone < 10:
            time.sleep(0.2)
        assert not processes_mentioning(config_path), "ranks outlived the stop"
    finally:
        attempts.ABANDONED.pop(config_path).set()
        launch.join(60)
    state = ended["state"]
    assert state.is_cancelled() and "stopped (the stage failed)" in state.message, state
    assert gone - stopped_at < 30  # the launch thread returned (ranks reaped) well before the slow stage would end
    print(f"\nlaunch-nodes stop: ranks gone {gone - stopped_at:.1f} s after the request")
