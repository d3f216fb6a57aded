"""Text decoding is counted: bytes that are not UTF-8 (and unpaired surrogate escapes in JSON)
become U+FFFD, per file in the shard index; above data.max_replaced_fraction the file is a bad
source. And text columns that are valid text in another encoding of Arrow (a dictionary, large
strings) are read as text. Real files, real sharding."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import SEQ_LEN, VOCAB, data_config

from megatrain.data.index import DataError
from megatrain.data.shard import shard_corpus
from megatrain.data.sources import expand_sources, plan_units, read_documents

PROSE = "plain ascii prose that any tokenizer reads without a second thought. " * 40  # 2,800 bytes


def test_latin1_bytes_are_counted_in_the_index_and_the_summary(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    latin1 = tmp_path / "in" / "old.txt"
    latin1.write_bytes(PROSE.encode() + "Café au lait, à la carte.\n".encode("latin-1"))  # 2 bad bytes in 2,826
    (tmp_path / "in" / "clean.txt").write_text(PROSE + "naïve UTF-8 text is no replacement\n")
    index = shard_corpus(data_config([str(tmp_path / "in")], str(tmp_path / "shards"), max_replaced_fraction=0.01),
                         SEQ_LEN, VOCAB)
    assert index.replaced_bytes == {str(latin1): 2}  # the clean file, with its own é, is not listed
    assert "text decoding: 2 bytes that are not UTF-8 became U+FFFD in 1 file (most: old.txt 2)" in index.summary()
    assert json.loads((Path(index.url) / "index.json").read_text())["replaced_bytes"] == {str(latin1): 2}


def test_a_file_above_the_threshold_is_a_bad_source(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    # the bad bytes lie past the 64 KiB head that identify reads: only reading the file finds them
    latin1 = tmp_path / "in" / "french.txt"
    data = PROSE.encode() * 30 + "Élève, été, où, déjà.\n".encode("latin-1") * 20  # 7 bytes not UTF-8 a line
    latin1.write_bytes(data)
    said = f"140 of its {len(data):,} bytes are not UTF-8"
    kept = tmp_path / "in" / "zz-kept.txt"
    kept.write_text(PROSE)
    assert [f.kind for f in expand_sources([str(tmp_path / "in")])[0]] == ["text", "text"]
    cfg = data_config([str(tmp_path / "in")], str(tmp_path / "shards"))  # the default limit, 0.001
    with pytest.raises(DataError, match=rf"^{latin1}: {said} .*"
                                        r"data.max_replaced_fraction=0.001"):
        shard_corpus(cfg, SEQ_LEN, VOCAB)
    index = shard_corpus(cfg.model_copy(update={"on_bad_source": "skip"}), SEQ_LEN, VOCAB)
    assert [b["url"] for b in index.bad_sources] == [str(latin1)]
    assert said in index.bad_sources[0]["reason"]
    assert [f["url"] for f in index.inputs["files"]] == [str(latin1), str(kept)] and index.replaced_bytes == {}
    raised = shard_corpus(cfg.model_copy(update={"max_replaced_fraction": 0.01, "shard_url": str(tmp_path / "more")}),
                          SEQ_LEN, VOCAB)
    assert raised.replaced_bytes == {str(latin1): 140} and raised.bad_sources == []


def test_an_unpaired_surrogate_escape_in_jsonl_is_replaced_and_counted(tmp_path: Path) -> None:
    """Invented member of the class: a JSONL line whose text holds half of an emoji's surrogate
    pair (``"\\ud83d"``, as a JavaScript writer that cut a string emits it). json.loads gives a
    str the tokenizer refuses with a bare TypeError naming neither file nor line."""
    path = tmp_path / "chat.jsonl"
    lines = [{"text": PROSE + "cut emoji \ud83d here"}, {"text": "whole emoji \ud83d\ude00 stays"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))  # json.dumps writes the \ud83d escapes
    assert "\\ud83d here" in path.read_text()
    index = shard_corpus(data_config([str(path)], str(tmp_path / "shards"), max_replaced_fraction=0.01), SEQ_LEN, VOCAB)
    assert index.replaced_bytes == {str(path): 1} and index.num_samples > 0
    files, _ = expand_sources([str(path)])
    units, _ = plan_units(files)
    replaced: dict[str, int] = {}
    assert list(read_documents(units[0], "text", replaced=replaced)) == [
        PROSE + "cut emoji \ufffd here", "whole emoji \U0001f600 stays"]
    assert replaced == {str(path): 1}


def _dictionary_stream_folder(folder: Path, docs: list[str]) -> Path:
    """An Arrow dataset folder as save_to_disk lays it out, its text column dictionary-encoded."""
    folder.mkdir()
    table = pa.table({"text": pa.array(docs).dictionary_encode()})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=7)
    (folder / "data-00000-of-00001.arrow").write_bytes(sink.getvalue())
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text(json.dumps({}))
    return folder


@pytest.mark.parametrize("column", ["dictionary", "large_string", "large_string dictionary"])
def test_dictionary_and_large_string_columns_are_text(tmp_path: Path, column: str) -> None:
    docs = [f"document {i % 5}: the same few texts, as a categorical column holds them" for i in range(30)]
    values = pa.array(docs, pa.large_string() if "large_string" in column else pa.string())
    path = tmp_path / "web.parquet"
    pq.write_table(pa.table({"content": values.dictionary_encode() if "dictionary" in column else values}), path,
                   row_group_size=10)
    assert ("dictionary" in str(pq.ParquetFile(path).schema_arrow.field("content").type)) == ("dictionary" in column)
    files, _ = expand_sources([str(path)])
    units, _ = plan_units(files, target_bytes=1, text_field="content")  # the column checked from the footer
    assert [d for u in units for d in read_documents(u, "content")] == docs
    folder = _dictionary_stream_folder(tmp_path / "books", docs)
    units, _ = plan_units(expand_sources([str(folder)])[0], text_field="text")
    assert [d for u in units for d in read_documents(u, "text")] == docs
