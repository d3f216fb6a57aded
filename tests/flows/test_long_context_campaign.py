"""configs/campaign-long-context.yaml through the real ``pretrain`` flow: a short-context stage, then
the last stage at 8x the length with context parallelism over the 2 ranks, the document mask and
RoPE extended (base raised, YaRN). The campaign is the committed one, shortened (a few steps a
stage, less source) and with its paths under tmp. Checked: the stage's one line in the Prefect log
and in the ranks' log, the last stage's run config and tokens at the new length with cp 2, the data
handoff of the data position, and the exported LlamaForCausalLM giving megatrain's logits at the new length."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.report.runs import read_metrics

ROOT = Path(__file__).resolve().parents[2]
LINE = ("stage long: context extension from stage short: seq_len 64 -> 512, rope_theta 10000 -> 500000, "
        "rope_scaling none -> yarn (factor 8, original 64), attention_mask causal -> document, cp 1 -> 2")


def flow_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    rows: list = []
    with get_client(sync_client=True) as client:
        while True:  # every page (a read returns at most 200)
            found = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                     limit=200, offset=len(rows))
            rows += found
            if len(found) < 200:
                return [row.message for row in rows]


@pytest.mark.slow
def test_the_last_stage_extends_the_context(prefect_api, tmp_path, shard_root):
    from flows.pretrain import pretrain

    campaign = yaml.safe_load((ROOT / "configs/campaign-long-context.yaml").read_text())
    assert campaign["recipe"].endswith("llama-tiny-cpu.yaml") and campaign["nproc_per_node"] == 2
    campaign.update(id="long-test", recipe=str(ROOT / campaign["recipe"]), root_dir=str(tmp_path / "campaigns"),
                    shard_url=str(shard_root), self_check=False, samples=0)
    campaign["overrides"] += ["data.max_source_bytes=400000", "checkpoint.interval=4"]
    short, long = campaign["stages"]
    short["steps"], long["steps"] = 6, 4
    path = tmp_path / "campaign-long.yaml"
    path.write_text(yaml.safe_dump(campaign))

    state = pretrain(str(path), return_state=True)
    report = state.result()

    assert [s["steps"] for s in report["stages"]] == [6, 4]
    loaded = load_campaign(path)
    first, last = stage_config(loaded, 0), stage_config(loaded, 1)
    # the one line, from the train-stage task (Prefect's log) and from restore on rank 0 (the ranks' log)
    logs = flow_logs(state.state_details.flow_run_id)
    assert logs.count(LINE) == 1
    ranks_log = (Path(last.train.run_dir) / "logs" / "attempt-1.log").read_text()
    assert LINE in ranks_log

    # the last stage ran at 512 with cp 2 (its run config as the ranks read it, and its tokens)
    ran = yaml.safe_load((Path(last.train.run_dir) / "config.yaml").read_text())
    assert (ran["train"]["seq_len"], ran["parallel"]["cp"], ran["model"]["attention_mask"]) == (512, 2, "document")
    rows = read_metrics(last.train.run_dir)
    assert rows[-1]["step"] == 4 and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["tokens"] == 4 * 2 * 512  # 2 samples of 512 a step
    # the data handoff: the last stage was given each component's cursor where the short stage's final
    # step stood. The shards are packed per seq_len and a cursor counts samples of one packing, so the
    # ranks start the re-packed data at its sample 0; the stage's log says so (not silently)
    from megatrain.checkpoint.files import step_dir_name
    from megatrain.data.position import end_cursors

    def data_position(cfg, step):
        manifest = Path(cfg.checkpoint.durable_url) / step_dir_name(step) / "manifest.json"
        return json.loads(manifest.read_text())["data_position"]["0"]

    carried = end_cursors(data_position(first, 6))
    assert carried["data"]["samples"] == 6 * 16
    assert {name: dict(c) for name, c in ran["data"]["cursors"].items()} == carried
    assert data_position(last, 4)["start"] == carried  # the ranks' loader was built from them
    assert any("the data is re-packed at seq_len 512" in line for line in logs)
    assert "starts at its sample 0: the previous stage's cursor is of another sample order" in ranks_log

    # the exported model: LlamaForCausalLM with YaRN in config.json, megatrain's logits at the new length
    import transformers

    from megatrain.interop.checkpoint import load_run

    model_dir = loaded.campaign_dir / "model"
    exported = json.loads((Path(last.train.run_dir) / "export.json").read_text())
    assert exported["exported"] and exported["architecture"] == "LlamaForCausalLM", exported.get("reason")
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["max_position_embeddings"] == 512
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]) == (
        "yarn", 8.0, 64, 500000.0)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ours = load_run(last.checkpoint.durable_url).model
    assert ours.eos_id is not None  # the document mask as trained

    # one document (no EOS inside): transformers' LlamaForCausalLM has no document mask, and on one
    # document megatrain's is the causal mask
    ids = torch.randint(0, last.model.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    eos = load_run(last.checkpoint.durable_url).eos_id()
    ids[ids == eos] = (eos + 1) % last.model.vocab_size
    with torch.no_grad():
        theirs, mine = hf(ids).logits.float(), ours(ids).float()
    assert theirs.shape == mine.shape == (1, 512, last.model.vocab_size)
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
