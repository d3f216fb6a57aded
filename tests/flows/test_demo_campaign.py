"""configs/campaign-local.yaml (``make demo``) through the real ``pretrain`` flow, shortened: its
kill and NaN faults recovered, TensorBoard showing only the surviving timeline, and the campaign
ending with a Hugging Face folder that transformers loads with megatrain's logits (1e-4, fp32)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.observe.tensorboard import read_scalars
from megatrain.report.runs import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_demo_campaign_recovers_and_ends_with_a_model_transformers_loads(prefect_api, tmp_path, shard_root):
    from flows.pretrain import pretrain

    campaign = yaml.safe_load((ROOT / "configs/campaign-local.yaml").read_text())
    campaign.update(id="demo-test", recipe=str(ROOT / campaign["recipe"]), root_dir=str(tmp_path / "campaigns"),
                    shard_url=str(shard_root), self_check=False, samples=1)
    campaign["overrides"] += ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2",
                              "train.eval_interval=4", "reliability.heartbeat_interval_s=0.5"]
    first, second = campaign["stages"]
    first["steps"], second["steps"] = 6, 6
    first["overrides"][-1] = "reliability.faults=[{kind: kill_rank, step: 3, rank: 1}]"
    second["overrides"][-1] = "reliability.faults=[{kind: nan_loss, step: 4, rank: 0}]"
    path = tmp_path / "campaign-local.yaml"
    path.write_text(yaml.safe_dump(campaign))

    report = pretrain(str(path))
    assert [(s["restarts"], s["rollbacks"]) for s in report["stages"]] == [(1, 0), (0, 1)]
    loaded = load_campaign(path)
    for index in range(2):
        run_dir = Path(stage_config(loaded, index).train.run_dir)
        rows = read_metrics(run_dir)
        steps = [s for s, _ in read_scalars(run_dir / "tb")["train/loss"]]
        assert steps == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)

    exported = json.loads((Path(stage_config(loaded, 1).train.run_dir) / "export.json").read_text())
    assert exported["exported"] and exported["architecture"] == "GPTNeoXForCausalLM" and exported["step"] == 6
    assert exported["max_logit_diff"] <= 1e-4
    assert exported["samples"][0]["transformers"] == exported["samples"][0]["megatrain"]  # greedy, same model
    # independently: transformers loads the folder, and its logits are megatrain's
    import transformers

    from megatrain.interop.checkpoint import load_run

    model = transformers.AutoModelForCausalLM.from_pretrained(exported["path"], torch_dtype=torch.float32).eval()
    run = load_run(stage_config(loaded, 1).train.run_dir)
    ids = torch.tensor([run.tokenizer().encode("def fibonacci(n):\n    return").ids])
    with torch.no_grad():
        assert (model(ids).logits - run.model(ids)).abs().max() <= 1e-4
    assert "GPTNeoXForCausalLM" in Path(report["report"]).read_text()
