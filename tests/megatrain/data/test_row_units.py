"""A Parquet row group or an Arrow data file much larger than a work unit is cut into row-range
units (tabular_units.py): they read back exactly the whole file's documents, in order, and an
Arrow file's units are planned and read without reading the record batches they do not hold.
Real files: pyarrow writes the Parquet, ``datasets`` the Arrow folder."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import SEQ_LEN, VOCAB, data_config
from test_sources import save_dataset

from megatrain import storage
from megatrain.data import source_formats
from megatrain.data.shard import shard_corpus
from megatrain.data.shard_unit import load_plan, read_unit
from megatrain.data.sources import expand_sources, plan_units, read_documents
from megatrain.data.tabular_units import balanced

WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()
_rng = random.Random(0)
DOCS = [f"document {i}: " + " ".join(_rng.choices(WORDS, k=10 * (i % 23 + 1))) for i in range(3000)]  # ~1.6 MB


class CountingReads:
    """storage.open_url, its bytes read counted per file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes: dict[str, int] = {}
        real = storage.open_url

        def counted(url: str, mode: str = "rb"):
            handle, log = real(url, mode), self.bytes

            class Counted:
                def read(self, size: int = -1) -> bytes:
                    data = handle.read(size)
                    log[url] = log.get(url, 0) + len(data)
                    return data

                def __getattr__(self, name: str):
                    return getattr(handle, name)

            return Counted()

        monkeypatch.setattr(source_formats.storage, "open_url", counted)


def test_one_large_parquet_row_group_is_cut_into_row_ranges(tmp_path: Path) -> None:
    path = tmp_path / "web.parquet"
    pq.write_table(pa.table({"content": DOCS}), path, row_group_size=len(DOCS))  # pandas' way: one row group
    files, _ = expand_sources([str(path)])
    size = pq.ParquetFile(path).metadata.row_group(0).column(0).total_compressed_size
    units, _ = plan_units(files, target_bytes=size // 5, group_bytes=1, text_field="content")
    assert [u.part for u in units] == [(0, 1)] * 5
    assert [u.rows for u in units] == [(0, 600), (600, 1200), (1200, 1800), (1800, 2400), (2400, 3000)]
    assert len({str(u.describe()) for u in units}) == 5  # each its own id
    assert [d for u in units for d in read_documents(u, "content")] == DOCS
    whole, _ = plan_units(files, text_field="content")  # a unit of 64 MiB: nothing to cut
    assert [(u.part, u.rows) for u in whole] == [((0, 1), None)] and "rows" not in whole[0].describe()


def test_one_large_arrow_data_file_is_cut_by_its_batches_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_dataset(tmp_path / "books", DOCS, 1, monkeypatch)  # one data file, batches of 1000 rows
    data_file = str(next(folder.glob("data-*.arrow")))
    size = Path(data_file).stat().st_size
    reads = CountingReads(monkeypatch)
    files, _ = expand_sources([str(folder)])
    units, _ = plan_units(files, target_bytes=size // 4, group_bytes=1, text_field="text")
    assert reads.bytes.get(data_file, 0) < 4096  # planning read the message headers only
    assert [u.part for u in units] == [(0, 1)] * 4 and units[0].rows[0] == 0 and units[-1].rows[1] == len(DOCS)
    assert all(a.rows[1] == b.rows[0] for a, b in itertools.pairwise(units))
    shares = [u.bytes for u in units]  # balanced by bytes, though later documents are longer
    assert max(shares) < 1.3 * min(shares), shares
    reads.bytes.clear()
    first = list(read_documents(units[0], "text"))
    assert first == DOCS[: units[0].rows[1]]
    assert reads.bytes[data_file] < size * 0.6  # its batches (and the schema), not the file
    assert [d for u in units for d in read_documents(u, "text")] == DOCS


def test_balanced_cuts_are_whole_and_ordered() -> None:
    batches = [(1000, 5000), (1000, 1000), (34, 90000), (1, 10)]  # 34 long books in one batch
    for parts in range(1, 40):
        spans = balanced(batches, parts)
        rows = [r for span, _ in spans for r in range(*span)]
        assert rows == list(range(2035)), parts
        assert len(spans) <= parts


def test_a_sharded_cut_file_is_the_same_corpus(tmp_path: Path) -> None:
    """A one-row-group Parquet file sharded in row-range units holds the same documents and
    tokens as when it is one unit: a cut changes the work, not the corpus."""
    path = tmp_path / "web.parquet"
    pq.write_table(pa.table({"content": DOCS}), path, row_group_size=len(DOCS))
    versions = {}
    for unit_bytes in (1 << 16, 64 << 20):
        cfg = data_config([str(path)], str(tmp_path / f"shards-{unit_bytes}"), text_field="content",
                          unit_bytes=unit_bytes)
        index = shard_corpus(cfg, SEQ_LEN, VOCAB)
        plan = load_plan(index.url)
        records = [read_unit(plan, i) for i in range(len(plan.units))]
        versions[unit_bytes] = (index, plan, sum(r["documents"] for r in records), sum(r["tokens"] for r in records))
    (cut, cut_plan, *cut_counts), (whole, whole_plan, *whole_counts) = versions.values()
    assert len(cut_plan.units) >= 4 and all(u.rows is not None for u in cut_plan.units)
    assert len(whole_plan.units) == 1 and whole_plan.units[0].rows is None
    assert cut_counts == whole_counts and cut_counts[0] == len(DOCS)
    assert cut.tokenizer_sha256 == whole.tokenizer_sha256 and cut.num_samples == whole.num_samples
    assert cut.params["unit_plan"] == 2
