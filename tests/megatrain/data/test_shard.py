"""Sharding: text -> tokenizer -> packed windows -> tar shards + index, on real files."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import SEQ_LEN, VOCAB, all_windows, data_config
from tokenizers import Tokenizer

from megatrain import storage
from megatrain.data import shard
from megatrain.data.index import DataError, load_index
from megatrain.data.shard import cli, collect_inputs, shard_corpus


def expected_windows(corpus: Path, tokenizer: Tokenizer, eos_id: int) -> np.ndarray:
    """The packing rule written out independently: files in sorted order, one document per file
    (per line in JSONL), each followed by EOS, cut into windows of seq_len + 1, tail dropped."""
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
    expected = expected_windows(corpus, tokenizer, small_index.eos_id)
    stored = np.concatenate(all_windows(small_index))
    assert stored.dtype == np.uint16 and small_index.dtype == "uint16"
    np.testing.assert_array_equal(stored, expected)
    assert small_index.num_samples == len(expected) and small_index.num_tokens == expected.size
    assert [s.num_samples for s in small_index.shards[:-1]] == [50] * (len(small_index.shards) - 1)


def test_index_describes_the_files(small_index):
    assert small_index.vocab_size <= VOCAB
    tokenizer_bytes = storage.read_bytes(small_index.tokenizer_url)
    assert hashlib.sha256(tokenizer_bytes).hexdigest() == small_index.tokenizer_sha256
    assert Tokenizer.from_str(tokenizer_bytes.decode()).token_to_id("<|endoftext|>") == small_index.eos_id
    for i, info in enumerate(small_index.shards):
        data = storage.read_bytes(small_index.shard_url(i))
        assert info.name == f"shard-{i:06d}.tar"
        assert (len(data), hashlib.sha256(data).hexdigest()) == (info.bytes, info.sha256)
    assert small_index.url.endswith("/" + small_index.version)
    assert [f[0].rsplit("/", 1)[-1] for f in small_index.inputs["files"]] == [
        "bisect.py", "colorsys.py", "docs.jsonl", "fnmatch.py", "notes.md", "textwrap.py"]
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


def test_output_is_deterministic_and_independent_of_worker_count(small_index, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(shard, "FILES_PER_TASK_BYTES", 8_000)  # several tasks: the process pool runs
    again = shard_corpus(data_config([str(corpus)], str(tmp_path / "a"), num_workers=2), SEQ_LEN, VOCAB)
    assert again.version == small_index.version
    assert again.tokenizer_sha256 == small_index.tokenizer_sha256
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in small_index.shards]


def test_stdlib_source_is_sorted_bounded_and_pure(tmp_path):
    files = collect_inputs(["stdlib"], 300_000)
    urls = [f.url for f in files]
    assert urls == sorted(urls) and all(u.endswith(".py") for u in urls)
    assert not any("site-packages" in u for u in urls)
    assert sum(f.limit for f in files) == 300_000
    assert collect_inputs(["stdlib"], 300_000) == files
    index = shard_corpus(data_config(["stdlib"], str(tmp_path), max_source_bytes=60_000), SEQ_LEN, VOCAB)
    assert index.inputs["bytes"] == 60_000 and index.num_samples > 100


def test_loaded_tokenizer_json_is_used_as_is(small_index, corpus, tmp_path):
    cfg = data_config([str(corpus / "textwrap.py")], str(tmp_path), tokenizer=small_index.tokenizer_url)
    index = shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert index.tokenizer_sha256 == small_index.tokenizer_sha256
    with pytest.raises(DataError, match="exceeds the model's 300"):
        shard_corpus(cfg, SEQ_LEN, 300)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (["{tmp}/missing.txt"], "missing.txt.*no such file"),
        (["{tmp}/*.nothing"], r"\*.nothing.*matches no file"),
        (["{tmp}/empty.txt"], "corpus is empty"),
        (["{tmp}/tiny.txt"], "fewer than 33 tokens"),
        (["{tmp}/bad.jsonl"], r"bad.jsonl:2: no 'text' text field"),
    ],
)
def test_bad_sources_name_the_file(tmp_path, sources, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("just a few words")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    cfg = data_config([s.format(tmp=tmp_path) for s in sources], str(tmp_path / "out"))
    with pytest.raises(DataError, match=message):
        shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("index.json"))


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
