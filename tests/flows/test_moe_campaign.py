"""Mixture-of-Experts through the real ``pretrain`` flow on CPU (issue 32): configs/campaign-moe-local.yaml
shortened, recovering from the demo's kill and NaN with an expert-load heat map per stage in the
report and as a Prefect artifact; and a planted router collapse rolled back like a loss spike.

Shortened means one layer (routed: ``model.moe.dense_layers=0``), 6-8 steps a stage, faults
moved inside them, every path under tmp."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.report.runs import read_metrics, read_raw_metrics
from fault_matrix_common import run_campaign, write_campaign

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = ROOT / "configs/campaign-moe-local.yaml"
ONE_ROUTED_LAYER = ["model.n_layer=1", "model.moe.dense_layers=0"]


def test_the_moe_campaign_is_the_demo_on_the_moe_recipe_with_router_checks_on():
    campaign = load_campaign(CAMPAIGN)
    assert campaign.recipe.endswith("moe-tiny-cpu.yaml") and campaign.nproc_per_node == 2
    for index, kind in enumerate(("kill_rank", "nan_loss")):
        cfg = stage_config(campaign, index)
        assert cfg.model.mlp == "moe" and cfg.model.moe.n_experts == 8
        assert [f.kind for f in cfg.reliability.faults] == [kind]
        anomaly = cfg.reliability.anomaly
        assert (anomaly.router_collapse_share, anomaly.router_collapse_steps, anomaly.dead_experts) == (0.9, 20, True)


async def _artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    async with get_client() as client:
        found = await client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])))
    return found[0] if found else None


@pytest.mark.slow
def test_moe_campaign_recovers_from_a_kill_and_a_nan_with_an_expert_load_map_per_stage(prefect_api, tmp_path, shard_root):
    from flows.pretrain import pretrain

    campaign = yaml.safe_load(CAMPAIGN.read_text())
    campaign.update(id="moe-test", recipe=str(ROOT / campaign["recipe"]), root_dir=str(tmp_path / "campaigns"),
                    shard_url=str(shard_root), self_check=False, samples=1)
    campaign["overrides"] += [*ONE_ROUTED_LAYER, "data.max_source_bytes=400000", "checkpoint.interval=2",
                              "train.log_interval=1", "reliability.heartbeat_interval_s=0.5"]
    first, second = campaign["stages"]
    first["steps"], second["steps"] = 6, 6
    first["overrides"][-1] = "reliability.faults=[{kind: kill_rank, step: 3, rank: 1}]"
    second["overrides"][-1] = "reliability.faults=[{kind: nan_loss, step: 4, rank: 0}]"
    path = tmp_path / "campaign-moe.yaml"
    path.write_text(yaml.safe_dump(campaign))

    report = pretrain(str(path))

    assert [(s["steps"], s["restarts"], s["rollbacks"]) for s in report["stages"]] == [(6, 1, 0), (6, 0, 1)]
    loaded = load_campaign(path)
    for index, name in enumerate(("short-context", "full-context")):
        rows = read_metrics(stage_config(loaded, index).train.run_dir)
        assert [r["step"] for r in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)
        share = rows[-1]["moe"]["layers"]["0"]["share"]
        assert len(share) == 8 and abs(sum(share) - 1) < 1e-3
        png = Path(report["pictures"][f"{name}: expert load"])
        assert png.parent == Path(report["campaign_dir"]) / "report" and png.stat().st_size > 5_000
    artifact = asyncio.run(_artifact("moe-test-expert-load"))
    assert artifact is not None and str(artifact.data).count("data:image/png;base64,") == 2
    assert Path(report["report"]).read_text().count("expert load](expert-load-") == 2


@pytest.mark.slow
def test_a_planted_router_collapse_rolls_the_stage_back_and_the_report_names_it(prefect_api, tmp_path, shard_root):
    """From step 3 every token of the routed layer goes to experts 0 and 1 (fault collapse_router,
    one attempt only); 2 steps of that is a collapse here, and the checks start at step 1 (not after
    the recipe's 5 warm-up steps), so the verdict comes at step 4, before step 4 is saved: the flow
    restores step 2, skips the window and trains to step 8."""
    path = write_campaign(tmp_path, "moe-collapse", shard_url=shard_root, faults=[{"kind": "collapse_router", "step": 3}],
                          overrides=[*ONE_ROUTED_LAYER, "reliability.anomaly.router_collapse_steps=2",
                                     "reliability.anomaly.router_warmup_steps=0"])
    doc = yaml.safe_load(path.read_text())
    doc["recipe"] = str(ROOT / "configs/moe-tiny-cpu.yaml")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))

    outcome = run_campaign(path)

    assert (outcome.stage["steps"], outcome.stage["restarts"], outcome.stage["rollbacks"]) == (8, 0, 1)
    record, = json.loads((outcome.run_dir / "rollbacks.json").read_text())
    assert (record["kind"], record["anomaly_step"], record["restore_step"]) == ("router_collapse", 4, 2)
    assert "layer 0: expert 0 took 100.0% of the tokens" in record["message"]
    raw = read_raw_metrics(outcome.run_dir)
    collapsed = [r["moe"]["layers"]["0"]["share"] for r in raw if r["step"] in (3, 4)][:2]  # the first attempt's
    assert collapsed == [[0.5, 0.5] + [0.0] * 6] * 2
    final = read_metrics(outcome.run_dir)
    assert [r["step"] for r in final] == list(range(1, 9))
    assert max(final[-1]["moe"]["layers"]["0"]["share"]) < 0.45  # the relaunch routes freely again
    text = Path(outcome.report["report"]).read_text()
    assert "**anomaly**: step 4: MoE layer 0: expert 0 took 100.0% of the tokens" in text  # the attempt, in the report
    assert "only: expert load" in outcome.report["pictures"]
