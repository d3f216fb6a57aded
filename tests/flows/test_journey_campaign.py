"""The journey of a team that continues a public base model on its own corpus, through the real
``pretrain`` flow against a real Prefect server: a small Llama with its own BPE tokenizer
(BOS, unk, pad, a chat template) is imported (``megatrain import``), then trained on a mixture of
three sources in three formats (a Parquet "web" set with its text in a ``content`` column,
``.jsonl.zst`` "code", a ``save_to_disk`` "books" folder), in a broad stage and an annealing stage
of other weights. Each component is sharded once for both stages, gets held-out documents of its
own and a validation loss beside the mix (the first stage's weights in both stages); the anneal
trains on each component's next samples (disjoint from the first stage's by sample id until the
component wraps); the metrics, ``megatrain status``, the report and TensorBoard show what each
component fed and agree on the numbers; the exported folder's tokenizer is the base model's, and
the report's export check says "same" for every greedy sample."""

from __future__ import annotations

import json
import subprocess
import sys
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

from numbers_agree import assert_numbers_agree

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "megatrain" / "interop"))
from hf_folders import save_llama, special_tokens  # noqa: E402  (the base model: a small Llama, its own BPE)

TEXT_FIELDS = {"web": "content"}  # the web set keeps its text in a column of its own name
BROAD = {"web": 0.625, "code": 0.25, "books": 0.125}  # of 32 samples: 20, 8 and 4
ANNEAL = {"web": 0.25, "code": 0.5, "books": 0.25}


def blend(sources: dict[str, str], weights: dict[str, float]) -> str:
    parts = [f"{{name: {name}, sources: [{sources[name]}], weight: {w}"
             + (f", text_field: {TEXT_FIELDS[name]}" if name in TEXT_FIELDS else "") + "}" for name, w in weights.items()]
    return "data.mixture=[" + ", ".join(parts) + "]"


def three_formats(folder: Path) -> dict[str, str]:
    """The standard library's text as a Parquet file (column ``content``), a zstd JSONL file and
    a ``datasets`` folder written by ``save_to_disk`` (12 short documents: too few for
    data.val_fraction alone to hold one out)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / "argparse.py").read_text()
    pq.write_table(pa.table({"id": list(range(len(text) // 2000 + 1)),
                             "content": [text[i:i + 2000] for i in range(0, len(text), 2000)]}), folder / "web.parquet")
    code = (stdlib / "tarfile.py").read_text()
    (folder / "code.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": code[i::8]}) + "\n" for i in range(8)).encode()))
    books = (stdlib / "textwrap.py").read_text()
    datasets.Dataset.from_dict({"text": [books[i::12] for i in range(12)]}).save_to_disk(str(folder / "books"))
    return {"web": str(folder / "web.parquet"), "code": str(folder / "code.jsonl.zst"), "books": str(folder / "books")}


def import_base_model(tmp_path: Path) -> tuple[Path, Path]:
    """The base model folder and the recipe ``megatrain import`` wrote for it."""
    base, recipe = tmp_path / "base", tmp_path / "continued.yaml"
    save_llama(base, max_position_embeddings=256, tie_word_embeddings=False)
    proc = subprocess.run([sys.executable, "-m", "megatrain.cli", "import", "--hf", str(base), "--config",
                           str(ROOT / "configs/llama-tiny-cpu.yaml"), "--out", str(recipe)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.max_source_bytes" not in yaml.safe_load(recipe.read_text()).get("data", {})  # no toy cap kept
    return base, recipe


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


def test_a_base_model_continued_on_three_formats_in_two_stages(prefect_api, tmp_path, capsys):
    from flows.pretrain import pretrain

    base, recipe = import_base_model(tmp_path)
    sources = three_formats(tmp_path)
    campaign = {
        "id": "annealed", "recipe": str(recipe), "nproc_per_node": 1,
        "root_dir": str(tmp_path / "campaigns"), "shard_url": str(tmp_path / "shards"), "self_check": False,
        "overrides": ["checkpoint.interval=2", "train.log_interval=1", "train.global_batch_size=8",
                      "train.micro_batch_size=8", "model.seq_len=64",
                      "reliability.heartbeat_interval_s=0.5", "reliability.heartbeat_timeout_s=60",
                      "data.val_fraction=0.05", "train.eval_interval=2"],
        "stages": [
            {"name": "broad", "steps": 4, "overrides": [blend(sources, BROAD)]},
            {"name": "anneal", "steps": 4, "overrides": [blend(sources, ANNEAL)]},
        ],
    }
    path = tmp_path / "annealed.yaml"
    path.write_text(yaml.safe_dump(campaign, sort_keys=False))

    report = pretrain(str(path))
    assert [s["attempts"] for s in report["stages"]] == [1, 1]
    loaded = load_campaign(path)
    assert_numbers_agree(loaded.campaign_dir, summary=report)  # the summary, status, report and TensorBoard
    first = stage_config(loaded, 0)
    assert first.checkpoint.init_from == f"hf:{base}" and first.model.vocab_size == 384  # the base model, as imported
    assert f"initialised the model from the transformers checkpoint {base}" in "".join(p.read_text() for p in (Path(first.train.run_dir) / "logs").glob("attempt-*.log"))
    for index, weights in enumerate((BROAD, ANNEAL)):
        cfg = stage_config(loaded, index)
        rows = read_metrics(cfg.train.run_dir)
        data = rows[-1]["data"]
        assert {name: c["weight"] for name, c in data.items()} == weights
        served = sum(c["samples"] for c in data.values())
        assert served == 4 * cfg.train.global_batch_size  # each stage starts its own blend at position 0
        assert {name: c["samples"] / served for name, c in data.items()} == weights  # 20/8/4 and 8/16/8 of 32: exact
        # validation per component, and val_loss their mix under the first stage's weights in both stages
        val = [r for r in rows if r.get("val_loss") is not None]
        assert [r["step"] for r in val] == [2, 4]
        for r in val:
            assert all(0 < r[f"val_loss/{name}"] < 20 for name in BROAD)
            assert r["val_loss"] == pytest.approx(sum(w * r[f"val_loss/{n}"] for n, w in BROAD.items()), rel=1e-6)
        record = json.loads((Path(cfg.train.run_dir) / "validation.json").read_text())
        assert record["weights"] == BROAD
        # every component holds documents out, the 12-document books too
        assert all(c["samples"] > 0 and c["documents"] >= 1 for c in record["components"].values()), record
        tb = read_scalars(Path(cfg.train.run_dir) / "tb")
        assert [v for _, v in tb["val/loss/code"]] == pytest.approx([r["val_loss/code"] for r in val], rel=1e-6)
    # three components, one version each, shared by both stages, all in the base model's tokenizer
    versions = sorted(p.parent.name for p in (tmp_path / "shards").glob("*/index.json"))
    assert len(versions) == 3
    check_the_anneal_continues_the_data(loaded, tmp_path / "shards")
    status = campaign_status(loaded.campaign_dir)
    names = sorted(BROAD)
    assert [sorted(s.data) for s in status.stages] == [names, names]
    assert [sorted(s.val_components) for s in status.stages] == [names, names]
    assert "code " in describe_validation(status.stages[1]) and "(w 0.25)" in describe_validation(status.stages[1])
    anneal_log = "".join(Path(log).read_text() for log in status.stages[1].logs)
    assert "validation mix (val_loss), from train.eval_weights" in anneal_log, anneal_log[-3000:]
    assert "web 0.625, code 0.25, books 0.125" in anneal_log, anneal_log[-3000:]
    report_md = Path(report["report"]).read_text()
    assert "code " in report_md and " tok " in report_md
    assert "## Validation by component" in report_md and "| anneal | books |" in report_md

    # the export: the base model's tokenizer, whole, and the report's check of it "same" throughout
    import transformers

    exported = loaded.campaign_dir / "model"
    theirs, ours = (transformers.AutoTokenizer.from_pretrained(d) for d in (base, exported))
    assert special_tokens(ours) == special_tokens(theirs)
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 256  # the base's, not 64
    check = json.loads((Path(stage_config(loaded, 1).train.run_dir) / "export.json").read_text())
    assert check["exported"] and check["samples"] and all(s["same"] and s["tokenizer_same"] for s in check["samples"]), check
    assert check["max_logit_diff"] < 1e-3
    assert report_md.count(": same") == len(check["samples"]) and "DIFFERENT" not in report_md

    # The annealing stage's blend changed on a rerun: its checkpoints hold the old blend, so the
    # stage is refused with the README's code for it (4, as `megatrain train` ends), the remedies a
    # campaign accepts (not checkpoint.durable_url, which it sets itself) and no "Resume:" command
    # (the same command fails alike); twice: the refusal is not taken from the cache as a finished
    # stage the second time.
    from flows.pretrain import main

    campaign["stages"][1]["overrides"] = [blend(sources, {"web": 0.5, "code": 0.25, "books": 0.25})]
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
