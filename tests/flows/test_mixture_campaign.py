"""A campaign whose second stage changes the data mixture (an annealing stage), through the real
``pretrain`` flow against a real Prefect server: each component is sharded once for both stages,
each stage trains on its own blend, the anneal on each component's next samples (disjoint from
the first stage's by sample id until the component wraps), and the metrics, ``megatrain status``
and the report show what each component fed, and each component's validation loss beside the
mix, whose weights are the first stage's in both stages."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import pytest
import yaml

from megatrain.checkpoint.catalog import read_manifest
from megatrain.checkpoint.files import step_dir_name
from megatrain.config.campaign import load_campaign, stage_config
from megatrain.data.index import load_index
from megatrain.data.mixture import Component, Mixture
from megatrain.data.position import end_cursors
from megatrain.observe.tensorboard import read_scalars
from megatrain.report.runs import read_metrics
from megatrain.report.status import campaign_status, describe_data, describe_validation

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def blend(sources: dict[str, str], weights: dict[str, float]) -> str:
    parts = [f"{{name: {name}, sources: [{sources[name]}], weight: {w}}}" for name, w in weights.items()]
    return "data.mixture=[" + ", ".join(parts) + "]"


def served_ids(cfg, shards: Path) -> tuple[dict, dict[str, list[tuple[int, int]]]]:
    """A stage's final data position (as its ranks committed it) and, per component, the sample
    ids (its epoch, stored sample number) of every position the stage trained on, in order."""
    step_url = f"{cfg.checkpoint.durable_url}/{step_dir_name(cfg.train.steps)}"
    state = read_manifest(step_url)["data_position"]["0"]
    components = [Component(c["name"], load_index(str(shards / c["version"])), c["weight"])
                  for c in state["mixture"]["components"]]
    order = Mixture(components).stream_order(seed=state["seed"], shuffle_shards=state["shuffle_shards"],
                                             start=state["start"])
    shard_ids, offsets, keys = order.pairs(0, state["samples_consumed"])
    out: dict[str, list[tuple[int, int]]] = {name: [] for name in order.mixture.names}
    for shard, offset, (c, epoch, _) in zip(shard_ids.tolist(), offsets.tolist(), keys.tolist()):
        before = sum(s.num_samples for s in order.mixture.shards[order.mixture.bases[c]:shard])
        out[order.mixture.names[c]].append((epoch, before + offset))
    return state, out


def check_the_anneal_continues_the_data(loaded, shards: Path) -> None:
    """The anneal's samples of each component are disjoint from the broad stage's (by sample id)
    until that component wraps, the wrap counts an epoch, and the cursors went from the broad
    stage's committed data position into the anneal's config and its ranks' state."""
    broad, anneal = (stage_config(loaded, i) for i in range(2))
    state1, ids1 = served_ids(broad, shards)
    state2, ids2 = served_ids(anneal, shards)
    written = yaml.safe_load((Path(anneal.train.run_dir) / "config.yaml").read_text())["data"]["cursors"]
    assert state1["start"] == {} and written == end_cursors(state1) == state2["start"]
    data2 = read_metrics(anneal.train.run_dir)[-1]["data"]
    for name, first in ids1.items():
        size = end_cursors(state1)[name]["epoch_len"]
        second = ids2[name]
        assert len(first) == end_cursors(state1)[name]["samples"] == data2[name]["start"] and len(second) > 0
        unseen = max(0, size - len(first))
        assert not {n for _, n in second[:unseen]} & {n for _, n in first}, name  # nothing replayed
        assert [e for e, _ in second] == [(len(first) + k) // size for k in range(len(second))]  # wraps counted
        assert data2[name]["epochs"] == (len(first) + len(second)) // size
        assert end_cursors(state2)[name]["samples"] == len(first) + len(second)
    tb = read_scalars(Path(anneal.train.run_dir) / "tb")
    assert tb["data/code/samples"][-1][1] == len(ids2["code"])
    status = campaign_status(loaded.campaign_dir)
    first_code = len(ids1["code"])
    assert f"(samples {first_code:,}-{first_code + len(ids2['code']) - 1:,})" in describe_data(status.stages[1].data)
    anneal_log = "".join(Path(log).read_text() for log in status.stages[1].logs)
    assert f"data component 'code' continues at its sample {first_code:,}" in anneal_log


def test_an_annealing_stage_changes_the_blend_and_shards_nothing_again(prefect_api, tmp_path, capsys):
    from flows.pretrain import pretrain

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = {"code": str(tmp_path / "code.jsonl"), "web": str(tmp_path / "web.jsonl.gz")}
    code = (stdlib / "tarfile.py").read_text()  # 8 documents: too few for data.val_fraction alone
    Path(sources["code"]).write_text("".join(json.dumps({"text": code[i::8]}) + "\n" for i in range(8)))
    with gzip.open(sources["web"], "wt") as handle:
        text = (stdlib / "argparse.py").read_text()
        for start in range(0, len(text), 2000):
            handle.write(json.dumps({"text": text[start:start + 2000]}) + "\n")
    campaign = {
        "id": "annealed", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 1,
        "root_dir": str(tmp_path / "campaigns"), "shard_url": str(tmp_path / "shards"), "self_check": False,
        "overrides": ["model.n_layer=1", "checkpoint.interval=2", "train.log_interval=1",
                      "reliability.heartbeat_interval_s=0.5", "reliability.heartbeat_timeout_s=60",
                      "data.val_fraction=0.05", "train.eval_interval=2"],
        "stages": [
            {"name": "broad", "steps": 4, "overrides": [blend(sources, {"code": 0.75, "web": 0.25})]},
            {"name": "anneal", "steps": 4, "overrides": [blend(sources, {"code": 0.25, "web": 0.75})]},
        ],
    }
    path = tmp_path / "annealed.yaml"
    path.write_text(yaml.safe_dump(campaign, sort_keys=False))

    report = pretrain(str(path))
    assert [s["attempts"] for s in report["stages"]] == [1, 1]
    loaded = load_campaign(path)
    for index, weights in enumerate(({"code": 0.75, "web": 0.25}, {"code": 0.25, "web": 0.75})):
        cfg = stage_config(loaded, index)
        rows = read_metrics(cfg.train.run_dir)
        data = rows[-1]["data"]
        assert {name: c["weight"] for name, c in data.items()} == weights
        served = sum(c["samples"] for c in data.values())
        assert served == 4 * cfg.train.global_batch_size  # each stage starts its own blend at position 0
        assert {name: c["samples"] / served for name, c in data.items()} == weights  # 8/32 and 24/32: exact
        # validation per component, and val_loss their mix under the first stage's weights in both stages
        val = [r for r in rows if r.get("val_loss") is not None]
        assert [r["step"] for r in val] == [2, 4]
        for r in val:
            assert 0 < r["val_loss/code"] < 20 and 0 < r["val_loss/web"] < 20
            assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/code"] + 0.25 * r["val_loss/web"], rel=1e-6)
        record = json.loads((Path(cfg.train.run_dir) / "validation.json").read_text())
        assert record["weights"] == {"code": 0.75, "web": 0.25}
        assert all(c["samples"] > 0 and c["documents"] >= 1 for c in record["components"].values())
        tb = read_scalars(Path(cfg.train.run_dir) / "tb")
        assert [v for _, v in tb["val/loss/code"]] == pytest.approx([r["val_loss/code"] for r in val], rel=1e-6)
    # two components, one version each, shared by both stages (plus the BPE trained on both)
    versions = sorted(p.parent.name for p in (tmp_path / "shards").glob("*/index.json"))
    assert len(versions) == 2
    check_the_anneal_continues_the_data(loaded, tmp_path / "shards")
    status = campaign_status(loaded.campaign_dir)
    assert [sorted(s.data) for s in status.stages] == [["code", "web"], ["code", "web"]]
    assert [sorted(s.val_components) for s in status.stages] == [["code", "web"], ["code", "web"]]
    assert "code " in describe_validation(status.stages[1]) and "(w 0.75)" in describe_validation(status.stages[1])
    anneal_log = "".join(Path(log).read_text() for log in status.stages[1].logs)
    assert "validation mix (val_loss), from train.eval_weights" in anneal_log and "code 0.75, web 0.25" in anneal_log
    report_md = Path(report["report"]).read_text()
    assert "code " in report_md and " tok " in report_md
    assert "## Validation by component" in report_md and "| anneal | code |" in report_md

    # The annealing stage's blend changed on a rerun: its checkpoints hold the old blend, so the
    # stage is refused with the README's code for it (4, as `megatrain train` ends), the remedies a
    # campaign accepts (not checkpoint.durable_url, which it sets itself) and no "Resume:" command
    # (the same command fails alike); twice: the refusal is not taken from the cache as a finished
    # stage the second time.
    from flows.pretrain import main

    campaign["stages"][1]["overrides"] = [blend(sources, {"code": 0.5, "web": 0.5})]
    path.write_text(yaml.safe_dump(campaign, sort_keys=False))
    for _ in range(2):
        capsys.readouterr()
        assert main([str(path), "--verbose"]) == 4
        (last,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatrain: campaign")]
        assert "stage anneal: CheckpointMismatch: " in last and "data.mixture" in last, last
        assert "change stage 'anneal' back to what the checkpoint has, or start a new campaign" in last, last
        assert "Resume:" not in last and "checkpoint.durable_url" not in last and "Not resumable as it is" in last


def test_a_stage_takes_the_cursors_of_the_previous_stages_final_step_unless_it_restarts(tmp_path):
    """The handoff alone (tasks/train.py): the previous stage's committed data position gives the
    next stage's data.cursors; data_cursor: restart gives none; a final step without one is refused."""
    from megatrain.checkpoint.catalog import MANIFEST
    from tasks.train import StageFailed, carried_data_cursors

    campaign = {"id": "handoff", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "root_dir": str(tmp_path),
                "stages": [{"name": "main", "steps": 3}, {"name": "anneal", "steps": 2},
                           {"name": "replay", "steps": 2, "data_cursor": "restart"}]}
    path = tmp_path / "handoff.yaml"
    path.write_text(yaml.safe_dump(campaign))
    loaded = load_campaign(path)
    step_dir = Path(loaded.stage_durable_url(0)) / step_dir_name(3)
    step_dir.mkdir(parents=True)
    position = {"format": 1, "version": "v1", "seed": 5, "shuffle_shards": 64, "samples_consumed": 24,
                "epoch_len": 40, "start": {}, "cursors": None}
    manifest = {"step": 3, "files": {}, "data_position": {"0": position}}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    assert carried_data_cursors(loaded, 0) is None
    cursors = carried_data_cursors(loaded, 1)
    assert {name: c.model_dump() for name, c in cursors.items()} == {"data": {
        "version": "v1", "seed": 5, "shuffle_shards": 64, "mixture": False, "samples": 24, "epoch_len": 40}}
    assert carried_data_cursors(loaded, 2) is None  # data_cursor: restart
    manifest["data_position"] = {}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StageFailed, match=r"stage anneal: stage main's final step .* records no data position"):
        carried_data_cursors(loaded, 1)
