"""configs/campaign-llama-local.yaml through the real ``pretrain`` flow: the Llama family with the
demo's fault recovery. The campaign is the committed one (recipe, overrides, faults, 2 ranks),
shortened (one layer, 6 steps a stage, faults moved inside them) and with its paths under tmp."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.observe.tensorboard import read_scalars
from megatrain.report.runs import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_llama_campaign_recovers_from_a_killed_rank_and_a_nan_loss(prefect_api, tmp_path, shard_root):
    from flows.pretrain import pretrain

    campaign = yaml.safe_load((ROOT / "configs/campaign-llama-local.yaml").read_text())
    assert campaign["recipe"].endswith("llama-tiny-cpu.yaml") and campaign["nproc_per_node"] == 2
    fault_kinds = [stage["overrides"][-1] for stage in campaign["stages"]]
    assert "kill_rank" in fault_kinds[0] and "nan_loss" in fault_kinds[1]
    campaign.update(id="llama-test", recipe=str(ROOT / campaign["recipe"]), root_dir=str(tmp_path / "campaigns"),
                    shard_url=str(shard_root), self_check=False)
    campaign["overrides"] += ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2"]
    first, second = campaign["stages"]
    first["steps"], second["steps"] = 6, 6
    first["overrides"][-1] = "reliability.faults=[{kind: kill_rank, step: 3, rank: 1}]"
    second["overrides"][-1] = "reliability.faults=[{kind: nan_loss, step: 4, rank: 0}]"
    path = tmp_path / "campaign-llama.yaml"
    path.write_text(yaml.safe_dump(campaign))

    report = pretrain(str(path))

    stages = report["stages"]
    assert [s["steps"] for s in stages] == [6, 6]
    assert stages[0]["restarts"] == 1 and stages[1]["rollbacks"] == 1
    loaded = load_campaign(path)
    for index in range(2):
        cfg = stage_config(loaded, index)
        assert (cfg.model.position, cfg.model.norm, cfg.model.mlp, cfg.model.kv_heads) == ("rope", "rmsnorm", "swiglu", 2)
        rows = read_metrics(cfg.train.run_dir)
        assert rows[-1]["step"] == 6 and all(math.isfinite(r["loss"]) for r in rows)
        # TensorBoard shows only the timeline that led to the final state: the killed attempt's
        # and the rolled-back NaN's steps are purged, the steps increase strictly, and each step's
        # loss is the one of the last attempt that logged it
        curve = read_scalars(Path(cfg.train.run_dir) / "tb")["train/loss"]
        steps = [step for step, _ in curve]
        assert steps == sorted(set(steps)) == list(range(1, 7)), steps
        last = {row["step"]: row["loss"] for row in rows}  # later rows (attempts) overwrite earlier ones
        assert [loss for _, loss in curve] == pytest.approx([last[step] for step in steps], rel=1e-6)
