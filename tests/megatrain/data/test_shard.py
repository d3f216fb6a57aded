"""Sharding: sources -> units -> tokenizer -> packed windows -> tar shards + index, on real files."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import SEQ_LEN, VOCAB, all_windows, data_config
from tokenizers import Tokenizer

from megatrain import storage
from megatrain.data import shard
from megatrain.data.index import DataError, load_index
from megatrain.data.shard import cli, plan_sharding, shard_corpus
from megatrain.data.shard_unit import read_unit, shard_unit
from megatrain.data.sources import expand_sources

UNIT_SHARD = re.compile(r"^units/[0-9a-f]{16}/shard-\d{6}\.tar$")


def expected_windows(corpus: Path, tokenizer: Tokenizer, eos_id: int) -> np.ndarray:
    """The packing rule of one unit written out independently: files in sorted order, one document
    per file (per line in JSONL), each followed by EOS, cut into windows of seq_len + 1."""
    ids: list[int] = []
    for path in sorted(corpus.iterdir()):
        text = path.read_text()
        docs = [json.loads(line)["text"] for line in text.splitlines()] if path.suffix == ".jsonl" else [text]
        for doc in docs:
            ids += tokenizer.encode(doc).ids + [eos_id]
    n = len(ids) // (SEQ_LEN + 1)
    return np.asarray(ids[: n * (SEQ_LEN + 1)]).reshape(n, SEQ_LEN + 1)


def test_shards_hold_exactly_the_packed_windows(small_index, corpus):
    tokenizer = Tokenizer.from_str(storage.read_bytes(small_index.tokenizer_url).decode())
    expected = expected_windows(corpus, tokenizer, small_index.eos_id)  # the corpus is one unit
    stored = np.concatenate(all_windows(small_index))
    assert stored.dtype == np.uint16 and small_index.dtype == "uint16"
    np.testing.assert_array_equal(stored, expected)
    assert small_index.num_samples == len(expected) and small_index.num_tokens == expected.size
    assert [s.num_samples for s in small_index.shards[:-1]] == [50] * (len(small_index.shards) - 1)
    assert small_index.format == 2


def test_index_describes_the_files(small_index):
    assert small_index.vocab_size <= VOCAB
    tokenizer_bytes = storage.read_bytes(small_index.tokenizer_url)
    assert hashlib.sha256(tokenizer_bytes).hexdigest() == small_index.tokenizer_sha256
    assert Tokenizer.from_str(tokenizer_bytes.decode()).token_to_id("<|endoftext|>") == small_index.eos_id
    for i, info in enumerate(small_index.shards):
        data = storage.read_bytes(small_index.shard_url(i))
        assert UNIT_SHARD.match(info.name), info.name
        assert (len(data), hashlib.sha256(data).hexdigest()) == (info.bytes, info.sha256)
    assert small_index.url.endswith("/" + small_index.version)
    assert [f["url"].rsplit("/", 1)[-1] for f in small_index.inputs["files"]] == [
        "bisect.py", "colorsys.py", "docs.jsonl", "fnmatch.py", "notes.md", "textwrap.py"]
    assert [f["kind"] for f in small_index.inputs["files"]] == ["text", "text", "jsonl", "text", "text", "text"]
    assert load_index(small_index.url) == small_index
    assert load_index(small_index.url + "/index.json") == small_index


def test_rerun_does_nothing_and_new_inputs_make_a_new_version(corpus, tmp_path):
    work = tmp_path / "corpus"
    work.mkdir()
    for path in corpus.iterdir():
        (work / path.name).write_bytes(path.read_bytes())
    cfg = data_config([str(work)], str(tmp_path / "shards"))
    first = shard_corpus(cfg, SEQ_LEN, VOCAB)
    index_file = Path(first.url) / "index.json"
    stamp = index_file.stat().st_mtime_ns
    started = time.perf_counter()
    assert shard_corpus(cfg, SEQ_LEN, VOCAB) == first
    assert time.perf_counter() - started < 1.0  # found the index: no tokenizer, no pool
    assert index_file.stat().st_mtime_ns == stamp

    (work / "more.txt").write_text("A new document arrives. " * 200)
    second = shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert second.version != first.version and second.num_samples > first.num_samples
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == sorted([first.version, second.version])
    assert load_index(first.url) == first  # the old version is left intact


@pytest.fixture
def several_units(monkeypatch):
    monkeypatch.setattr(shard, "GROUP_BYTES", 8_000)  # the corpus's small files in several units (planning only)


def test_every_worker_count_writes_the_same_index(several_units, corpus, tmp_path):
    one = shard_corpus(data_config([str(corpus)], str(tmp_path / "a"), num_workers=1), SEQ_LEN, VOCAB)
    two = shard_corpus(data_config([str(corpus)], str(tmp_path / "b"), num_workers=2), SEQ_LEN, VOCAB)
    assert len(shard_unit_dirs(one)) >= 3
    assert one.version == two.version and one.tokenizer_sha256 == two.tokenizer_sha256
    assert [(s.name, s.sha256) for s in one.shards] == [(s.name, s.sha256) for s in two.shards]
    assert (Path(one.url) / "index.json").read_bytes() == (Path(two.url) / "index.json").read_bytes()
    # each unit packs its own windows; what is left of each is packed at the end: no token lost
    # but the last partial window (and the units' order is the files' order)
    tokens = sum(read_unit(plan_for(two), i)["tokens"] for i in range(len(shard_unit_dirs(two))))
    assert tokens - two.num_tokens < SEQ_LEN + 1
    assert any(s.name.startswith("tail-shard-") for s in two.shards)


def shard_unit_dirs(index) -> list[Path]:
    return sorted((Path(index.url) / "units").iterdir())


def plan_for(index):
    from megatrain.data.shard_unit import load_plan

    return load_plan(index.url)


def test_a_unit_killed_midway_is_redone_and_a_finished_one_is_skipped(several_units, corpus, tmp_path):
    """Units are content-addressed: one with a unit.json is done; one without is done again,
    whatever it left behind. The index is the same as an uninterrupted run's."""
    cfg = data_config([str(corpus)], str(tmp_path / "shards"), num_workers=1)
    plan = plan_sharding(cfg, SEQ_LEN, VOCAB)
    first = shard_unit(plan, 0)
    done = Path(plan.unit_url(0)) / "unit.json"
    stamp = done.stat().st_mtime_ns
    assert shard_unit(plan, 0) == first and done.stat().st_mtime_ns == stamp  # skipped
    broken = Path(plan.unit_url(1))
    broken.mkdir(parents=True)
    (broken / "shard-000000.tar").write_bytes(b"half a tar from a killed worker")
    with pytest.raises(DataError, match="has not finished: run its shard task again"):
        shard.finish_sharding(plan)  # no index from a plan with a unit missing
    index = shard_corpus(cfg, SEQ_LEN, VOCAB)
    reference = shard_corpus(data_config([str(corpus)], str(tmp_path / "reference"), num_workers=1), SEQ_LEN, VOCAB)
    assert [s.sha256 for s in index.shards] == [s.sha256 for s in reference.shards]


def test_stdlib_source_is_sorted_bounded_and_pure(tmp_path):
    files, bad = expand_sources(["stdlib"], 300_000)
    urls = [f.url for f in files]
    assert urls == sorted(urls) and all(u.endswith(".py") for u in urls) and not bad
    assert not any("site-packages" in u for u in urls)
    assert sum(f.limit for f in files) == 300_000
    assert expand_sources(["stdlib"], 300_000)[0] == files
    index = shard_corpus(data_config(["stdlib"], str(tmp_path), max_source_bytes=60_000), SEQ_LEN, VOCAB)
    assert index.inputs["bytes"] == 60_000 and index.num_samples > 100


def test_loaded_tokenizer_json_is_used_as_is(small_index, corpus, tmp_path):
    cfg = data_config([str(corpus / "textwrap.py")], str(tmp_path), tokenizer=small_index.tokenizer_url)
    index = shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert index.tokenizer_sha256 == small_index.tokenizer_sha256
    with pytest.raises(DataError, match="exceeds the model's 300"):
        shard_corpus(cfg, SEQ_LEN, 300)


@pytest.mark.parametrize("post_processor_adds_bos", [False, True], ids=["config adds BOS", "both add BOS (Llama 2)"])
def test_a_model_folders_tokenizer_brings_its_bos_and_eos(small_index, corpus, tmp_path, post_processor_adds_bos):
    """data.tokenizer = a Hugging Face model folder: its tokenizer.json, BOS/EOS from its
    tokenizer_config.json; every document starts with one BOS and ends with one EOS, also where
    the tokenizer's own post-processor adds BOS as well."""
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path / "base-model"
    folder.mkdir()
    tokenizer = Tokenizer.from_str(storage.read_bytes(small_index.tokenizer_url).decode())
    tokenizer.add_special_tokens(["<s>", "</s>"])
    if post_processor_adds_bos:
        tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True}))
    index = shard_corpus(data_config([str(corpus / "notes.md")], str(tmp_path / "out"), tokenizer=str(folder)),
                         SEQ_LEN, VOCAB + 64)  # two tokens more than the corpus's BPE
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    assert (index.bos_id, index.eos_id) == (bos, eos)
    assert index.tokenizer_sha256 == hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    tokens = np.concatenate(all_windows(index)).reshape(-1)
    expected = [bos] + tokenizer.encode((corpus / "notes.md").read_text(), add_special_tokens=False).ids + [eos]
    np.testing.assert_array_equal(tokens, expected[: len(tokens)])

    (folder / "tokenizer.json").write_text(tokenizer.to_str()[:500])  # truncated: named, no parser trace
    with pytest.raises(DataError, match=r"tokenizer.json: not a valid tokenizer.json \(.*EOF"):
        shard_corpus(data_config([str(corpus / "notes.md")], str(tmp_path / "out2"), tokenizer=str(folder)),
                     SEQ_LEN, VOCAB + 64)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (["{tmp}/missing.txt"], "missing.txt.*no such file"),
        (["{tmp}/*.nothing"], r"\*.nothing.*matches no file"),
        (["{tmp}/empty.txt"], "corpus is empty"),
        (["{tmp}/tiny.txt"], "fewer than 33 tokens"),
        (["{tmp}/bad.jsonl"], r"bad.jsonl:2: no 'text' field"),
        (["{tmp}/corpus.parquet"], r"corpus.parquet: .*gzip"),
    ],
)
def test_bad_sources_name_the_file(tmp_path, sources, message):
    import gzip

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("just a few words")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    # gzip bytes named .parquet, holding no JSON object: once tokenized as bytes with exit code 0
    (tmp_path / "corpus.parquet").write_bytes(gzip.compress(b"\x00\x01\x02 binary \xff\xfe" * 100))
    cfg = data_config([s.format(tmp=tmp_path) for s in sources], str(tmp_path / "out"))
    with pytest.raises(DataError, match=message):
        shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("index.json"))


def test_a_version_of_format_1_is_found_and_read(corpus, tmp_path):
    """A corpus sharded before format 2 keeps its version (and a campaign's data position in
    it): the format-1 name is computed as that code did, here by its rule written out."""
    from megatrain.data.legacy import legacy_version

    cfg = data_config([str(corpus)], str(tmp_path / "shards"))
    files, _ = expand_sources(cfg.sources, cfg.max_source_bytes)
    params = {"format": 1, "seq_len": SEQ_LEN, "samples_per_shard": 50, "tokenizer": "bpe", "tokenizer_sha256": "",
              "bpe_vocab_size": VOCAB, "eos_token": "<|endoftext|>", "text_field": "text", "max_source_bytes": None}
    described = [[str(p), p.stat().st_size, str(p.stat().st_mtime), p.stat().st_size] for p in sorted(corpus.iterdir())]
    old_name = hashlib.sha256(json.dumps({"files": described, "params": params}, sort_keys=True).encode()).hexdigest()[:16]
    assert legacy_version(cfg, files, SEQ_LEN, VOCAB) == old_name
    new = shard_corpus(cfg, SEQ_LEN, VOCAB)  # no format-1 version there: a new one
    assert new.version != old_name and new.format == 2
    (tmp_path / "shards" / new.version).rename(tmp_path / "shards" / old_name)
    raw = json.loads((tmp_path / "shards" / old_name / "index.json").read_text())
    raw.update(format=1, version=old_name)
    (tmp_path / "shards" / old_name / "index.json").write_text(json.dumps(raw))
    found = shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert (found.version, found.format) == (old_name, 1)
    assert not (tmp_path / "shards" / new.version).exists()  # nothing sharded again


def test_load_index_errors_name_the_url(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}/index.json: no shard index"):
        load_index(str(tmp_path))
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(DataError, match="index.json: not valid JSON"):
        load_index(str(tmp_path))


def test_cli_prints_the_summary(corpus, tmp_path, capsys):
    argv = [f"data.sources=[{corpus}]", f"data.shard_url={tmp_path}", "data.samples_per_shard=64",
            f"model.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB}", "model.n_head=4", "model.d_model=64"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "samples of 32+1 tokens" in out and "vocab 512" in out
    assert cli([f"data.sources=[{tmp_path}/nope.txt]", f"data.shard_url={tmp_path}"]) == 1
    assert "nope.txt" in capsys.readouterr().err


def test_cli_shards_a_bpe_mixture_into_the_versions_the_trainer_reads(corpus, tmp_path):
    """`megatrain shard` of a mixture with a trained BPE: one tokenizer for all components (trained
    once on all of them), and exactly the versions the trainer's start looks for
    (shard.shard_components), so a pre-sharded corpus is not tokenized again at the first step."""
    import json as json_module

    from megatrain.config import load_config
    from megatrain.data.shard import shard_components

    mixture = json_module.dumps([{"name": "notes", "sources": [str(corpus / "notes.md")], "weight": 1},
                                 {"name": "rest", "sources": [str(corpus)], "weight": 2}])
    argv = [f"data.mixture={mixture}", f"data.shard_url={tmp_path}", "data.tokenizer=bpe", "data.bpe_vocab_size=300",
            f"model.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB}", "model.n_head=4", "model.d_model=64"]
    assert cli(argv) == 0
    written = sorted(p.parent.name for p in tmp_path.glob("*/index.json"))
    cfg = load_config(None, argv)
    indexes = shard_components(cfg.data, cfg.seq_len, cfg.model.vocab_size)  # finds them: writes nothing new
    assert sorted(p.parent.name for p in tmp_path.glob("*/index.json")) == written
    assert sorted(Path(index.url).name for index in indexes) == written and len(written) == 2
    assert len({(Path(index.url) / "tokenizer.json").read_bytes() for index in indexes}) == 1


def test_under_skip_a_refused_file_is_left_out_and_counted_in_the_index(corpus, tmp_path):
    (tmp_path / "picture.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 20)  # binary under a text name
    sources = [str(corpus / "notes.md"), str(tmp_path / "picture.txt")]
    with pytest.raises(DataError, match=r"picture.txt: .*(binary|PNG)"):
        shard_corpus(data_config(sources, str(tmp_path / "strict")), SEQ_LEN, VOCAB)
    assert not list((tmp_path / "strict").rglob("*.tar"))  # refused before anything was written
    index = shard_corpus(data_config(sources, str(tmp_path / "lenient"), on_bad_source="skip"), SEQ_LEN, VOCAB)
    assert [b["url"] for b in index.bad_sources] == [str(tmp_path / "picture.txt")]
    assert [f["url"] for f in index.inputs["files"]] == [str(corpus / "notes.md")] and index.num_samples > 0
