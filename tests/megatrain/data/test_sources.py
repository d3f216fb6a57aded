"""megatrain.data.sources on real files, each written by its own library: pyarrow writes the
Parquet, ``datasets`` the Arrow folder, gzip/zstandard/lzma/bz2 the compressed files. Every test
checks the exact documents read back, or the one DataError (or skip) a bad file gets."""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import logging
import lzma
import random
import sysconfig
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatrain.data.index import DataError
from megatrain.data.sources import (
    BadSource,
    WorkUnit,
    expand_sources,
    plan_units,
    read_documents,
)
from megatrain.errors import UnsafePathError

DOCS = [f"document {i}: " + "words and more words " * (i % 7) for i in range(40)]


def read_all(sources: list[str], on_bad_source: str = "error", **plan: int) -> tuple[list[str], list[BadSource]]:
    """Expand, plan and read every unit: (the documents in order, every bad source)."""
    files, bad = expand_sources(sources, on_bad_source=on_bad_source)
    units, bad_plan = plan_units(files, on_bad_source=on_bad_source, text_field="text", **plan)
    bad += bad_plan
    docs = [doc for unit in units for doc in read_documents(unit, "text", on_bad_source, bad)]
    return docs, bad


def jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)).encode()


def write_parquet(path: Path, docs: list[str], row_group_size: int = 8, **columns: list) -> Path:
    pq.write_table(pa.table({"text": docs, **columns}), path, row_group_size=row_group_size)
    return path


# ----------------------------------------------------------------------------- kinds of files
def test_each_kind_is_read_by_content(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.txt").write_text("plain text, one document\n")
    (tmp_path / "b.jsonl").write_bytes(b"\n" + jsonl(DOCS[:3]) + b"\n  \n" + b'{"text": ""}\n')
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS[3:6])))
    zstd = zstandard.ZstdCompressor()
    frames = zstd.compress(jsonl(DOCS[6:8])) + zstd.compress(jsonl(DOCS[8:9]))
    (tmp_path / "d.ndjson.zst").write_bytes(frames)  # two frames, as pzstd or an append writes
    (tmp_path / "e.parquet").write_bytes(gzip.compress(jsonl(DOCS[9:11])))  # a misleading name
    (tmp_path / "f").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS[11:12])))  # no name at all
    (tmp_path / "g.md.gz").write_bytes(gzip.compress(b"# compressed text\n"))
    (tmp_path / "h.bin").write_bytes(b"not a data suffix: a directory leaves it out")
    with caplog.at_level(logging.WARNING):
        files, bad = expand_sources([str(tmp_path), str(tmp_path / "f")])
    assert bad == []
    assert [(Path(f.url).name, f.kind, f.compression) for f in files] == [
        ("a.txt", "text", None), ("b.jsonl", "jsonl", None), ("c.jsonl.gz", "jsonl", "gzip"),
        ("d.ndjson.zst", "jsonl", "zstd"), ("e.parquet", "jsonl", "gzip"), ("f", "jsonl", "zstd"),
        ("g.md.gz", "text", "gzip")]
    assert "e.parquet: the name says parquet but the content is gzip-compressed jsonl" in caplog.text
    assert all(f.limit == f.size == (tmp_path / Path(f.url).name).stat().st_size for f in files)
    assert read_all([str(tmp_path), str(tmp_path / "f")])[0] == [
        "plain text, one document\n", *DOCS[:12], "# compressed text\n"]


def test_first_line_decides_between_jsonl_and_text(tmp_path: Path) -> None:
    (tmp_path / "records").write_bytes(b"\n" + jsonl(["a", "b"]))
    (tmp_path / "prose").write_bytes(b'["a list", "is not an object"]\nand then prose\n')
    (tmp_path / "object.txt").write_bytes(b'{"text": "a .txt name keeps it text"}\n')
    files, _ = expand_sources([str(tmp_path / name) for name in ("records", "prose", "object.txt")])
    assert [f.kind for f in files] == ["text", "text", "jsonl"]  # sorted: object.txt, prose, records
    assert read_all([str(tmp_path)])[0] == ['{"text": "a .txt name keeps it text"}\n']
    assert read_all([str(tmp_path / "records")])[0] == ["a", "b"]


def test_jsonl_line_errors_name_file_and_line(tmp_path: Path) -> None:
    for name, body, why in [("missing.jsonl", b'{"text": "ok"}\n\n{"body": "x"}\n', r":3: no 'text' field"),
                            ("number.jsonl", b'{"text": "ok"}\n{"text": 7}\n', ":2: field 'text' is int, not a str"),
                            ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', r":2: not JSON")]:
        (tmp_path / name).write_bytes(body)
        with pytest.raises(DataError, match=f"^{tmp_path / name}{why}"):
            read_all([str(tmp_path / name)])
    (tmp_path / "named.jsonl").write_text("prose under a JSONL name\n")
    with pytest.raises(DataError, match=f"^{tmp_path / 'named.jsonl'}:1: not a JSON object"):
        expand_sources([str(tmp_path / "named.jsonl")])  # known from the head: before anything is written


# --------------------------------------------------------------------------- Parquet and Arrow
def test_parquet_cut_by_row_groups(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "corpus.parquet", DOCS[:30] + [None, ""], n=list(range(32)))
    files, _ = expand_sources([str(path)])
    assert [(f.kind, f.limit) for f in files] == [("parquet", path.stat().st_size)]
    whole, _ = plan_units(files)
    assert [(u.part, len(u.files)) for u in whole] == [((0, 4), 1)]
    meta = pq.ParquetFile(path).metadata
    group_bytes = [sum(meta.row_group(g).column(c).total_compressed_size for c in range(2)) for g in range(4)]
    target = group_bytes[0] + 1
    units, _ = plan_units(files, target_bytes=target)
    assert units[0].part == (0, 2) and units[-1].part[1] == 4
    assert all(a.part[1] == b.part[0] for a, b in itertools.pairwise(units))  # consecutive, none left out
    for unit in units:  # each cut as soon as it holds target_bytes (the last: the rest)
        assert unit.bytes == sum(group_bytes[slice(*unit.part)])
        assert unit is units[-1] or unit.bytes - group_bytes[unit.part[1] - 1] < target <= unit.bytes
    assert [d for u in units for d in read_documents(u, "text")] == DOCS[:30]  # null and "" are no documents
    assert list(read_documents(whole[0], "text")) == DOCS[:30]


@pytest.mark.parametrize("column, problem", [("body", "no column 'body'"),
                                             ("n", "column 'n' holds int64, not strings")])
def test_parquet_without_a_text_column(tmp_path: Path, column: str, problem: str) -> None:
    path = write_parquet(tmp_path / "table.parquet", ["x"], n=[1])
    files, _ = expand_sources([str(path)])
    expected = f"^{path}: {problem}.*its columns: text \\(string\\), n \\(int64\\)"
    with pytest.raises(DataError, match=expected):
        plan_units(files, text_field=column)  # from the footer, at planning
    with pytest.raises(DataError, match=expected):
        list(read_documents(WorkUnit(tuple(files)), column))  # and again when read


def save_dataset(folder: Path, docs: list[str], shards: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(folder.parent / "hf-cache"))
    import datasets

    datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(folder), num_shards=shards)
    return folder


def test_arrow_folder_cut_by_data_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_dataset(tmp_path / "corpus" / "ds", DOCS, 4, monkeypatch)
    data = sorted(folder.glob("data-*.arrow"))
    (tmp_path / "corpus" / "notes.txt").write_text("beside the dataset")
    for source in (str(folder), str(tmp_path / "corpus")):  # the folder itself, or a directory above it
        files, _ = expand_sources([source])
        arrow = [f for f in files if f.kind == "arrow"]
        assert [(f.url, f.size) for f in arrow] == [(str(folder), sum(p.stat().st_size for p in data))]
    units, _ = plan_units(arrow, target_bytes=data[0].stat().st_size + 1, text_field="text")
    assert units[0].part == (0, 2) and units[-1].part[1] == 4
    assert all(a.part[1] == b.part[0] for a, b in itertools.pairwise(units))
    assert [d for u in units for d in read_documents(u, "text")] == DOCS
    assert read_all([str(tmp_path / "corpus")])[0] == DOCS + ["beside the dataset"]
    with pytest.raises(DataError, match=f"^{folder}: column 'n' holds .*int64.*its columns: text, n"):
        plan_units(arrow, text_field="n")


def test_arrow_folder_naming_a_file_outside_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_dataset(tmp_path / "ds", DOCS[:3], 1, monkeypatch)
    (tmp_path / "outside.arrow").write_bytes(next(folder.glob("*.arrow")).read_bytes())
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "../outside.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(UnsafePathError, match="'../outside.arrow' in .*state.json"):
        expand_sources([str(folder)])
    (tmp_path / "good.txt").write_text("kept")
    docs, bad = read_all([str(folder), str(tmp_path / "good.txt")], on_bad_source="skip")
    assert docs == ["kept"] and [b.url for b in bad] == [str(folder)] and "unsafe name" in bad[0].reason


# ------------------------------------------------------------------------------ refused files
def _truncated(compress) -> bytes:
    whole = compress(jsonl(DOCS))
    return whole[: len(whole) * 2 // 3]


def _broken_footer(path: Path) -> bytes:
    data = write_parquet(path, DOCS).read_bytes()
    return data[:-40] + b"\xff" * 36 + data[-4:]  # PAR1 still at both ends: only the footer is damaged


BAD_FILES = {  # name -> (bytes, what the error says)
    "image.png": (lambda p: b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64), r"binary \(PNG image\)"),
    "random.txt": (lambda p: random.Random(0).randbytes(4096), r"binary \(NUL bytes"),
    "nul.txt": (lambda p: b"text with a \x00 byte\n", r"binary \(NUL bytes from offset 12\)"),
    "koi8.txt": (lambda p: "Съешь же ещё этих мягких булок\n".encode("koi8_r") * 4, "undecodable text"),
    "corpus.jsonl.xz": (lambda p: lzma.compress(jsonl(DOCS)), r"unknown compression \(xz\)"),
    "corpus.jsonl.bz2": (lambda p: bz2.compress(jsonl(DOCS)), r"unknown compression \(bzip2\)"),
    "cut.jsonl.gz": (lambda p: _truncated(gzip.compress), "corrupt or truncated gzip data .*EOFError"),
    "cut.jsonl.zst": (lambda p: _truncated(zstandard.ZstdCompressor().compress),
                      "corrupt or truncated zstd data .*EOFError"),
    "archive.tar.gz": (lambda p: gzip.compress(bytes(257) + b"ustar" + bytes(250)),
                       r"gzip-compressed binary \(tar archive\)"),
    "footer.parquet": (_broken_footer, "a broken Parquet footer"),
    "cut.parquet": (lambda p: write_parquet(p, DOCS).read_bytes()[:-100], "a broken Parquet file: it starts with PAR1"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_refused_at_planning_or_skipped(tmp_path: Path, name: str) -> None:
    content, problem = BAD_FILES[name]
    bad_path = tmp_path / "in" / name
    bad_path.parent.mkdir()
    bad_path.write_bytes(content(tmp_path / "scratch.parquet"))
    good = tmp_path / "in" / "zz-good.jsonl"
    good.write_bytes(jsonl(DOCS[:2]))
    sources = [str(bad_path), str(good)]
    with pytest.raises(DataError, match=f"^{bad_path}: {problem}") as raised:
        files, _ = expand_sources(sources)
        plan_units(files, text_field="text")  # planning: before any document is read or written
    assert "\n" not in str(raised.value)
    docs, bad = read_all(sources, on_bad_source="skip")
    assert docs == DOCS[:2]
    assert bad == [BadSource(str(bad_path), str(raised.value).removeprefix(f"{bad_path}: "))]


def test_latin1_text_with_a_few_bad_bytes_is_read(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_bytes(("plain ascii prose " * 20).encode() + "café".encode("latin-1"))
    assert read_all([str(tmp_path / "old.txt")])[0] == ["plain ascii prose " * 20 + "caf\ufffd"]


@pytest.mark.parametrize("compress", [gzip.compress, zstandard.ZstdCompressor().compress], ids=["gzip", "zstd"])
def test_truncated_stream_found_midway_contributes_nothing(tmp_path: Path, compress) -> None:
    rng = random.Random(1)  # incompressible lines: the file is larger than the head read at planning
    big = [rng.randbytes(300).hex() for _ in range(600)]
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS[:2]))
    whole = compress(jsonl(big))
    (tmp_path / "b.jsonl.gz").write_bytes(whole[: len(whole) - 5000])
    (tmp_path / "c.jsonl").write_bytes(jsonl(DOCS[2:4]))
    files, _ = expand_sources([str(tmp_path)])  # planning cannot know: the cut is past the head
    units, _ = plan_units(files, group_bytes=10 << 20)
    assert len(units) == 1 and len(units[0].files) == 3
    with pytest.raises(DataError, match=f"^{tmp_path / 'b.jsonl.gz'}: corrupt or truncated"):
        list(read_documents(units[0], "text"))
    bad: list[BadSource] = []
    assert list(read_documents(units[0], "text", "skip", bad)) == DOCS[:4]  # none of b's ~500 good lines
    assert [b.url for b in bad] == [str(tmp_path / "b.jsonl.gz")]


def test_parquet_bad_page_is_one_data_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "pages.parquet", DOCS, row_group_size=20)
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    for at in range(start + 30, start + chunk.total_compressed_size - 5):  # page bodies, not the footer
        data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    units, _ = plan_units(expand_sources([str(path)])[0], target_bytes=1, text_field="text")  # footer intact
    assert [u.part for u in units] == [(0, 1), (1, 2)]
    assert list(read_documents(units[0], "text")) == DOCS[:20]
    with pytest.raises(DataError, match=f"^{path}: a broken Parquet row group 1 "):
        list(read_documents(units[1], "text"))
    bad: list[BadSource] = []
    assert [d for u in units for d in read_documents(u, "text", "skip", bad)] == DOCS[:20]
    assert len(bad) == 1 and bad[0].reason.startswith("a broken Parquet row group 1")


# ------------------------------------------------------------------------- byte ranges, budget
def test_jsonl_byte_ranges_equal_the_whole_file(tmp_path: Path) -> None:
    docs = [("x" * (i * 37 % 200)) + f"#{i}" for i in range(25)]
    body = jsonl(docs).replace(b"\n", b"\n\n", 3)  # blank lines too; lines up to ~230 bytes
    path = tmp_path / "long.jsonl"
    path.write_bytes(body)
    files, _ = expand_sources([str(path)])
    assert read_all([str(path)])[0] == docs
    for target in (1, 7, 50, 97, 1000):
        units, _ = plan_units(files, target_bytes=target, group_bytes=1)
        assert [d for u in units for d in read_documents(u, "text")] == docs, target
    for cut in range(len(body) + 1):  # every cut point: mid-line, on a newline, at the ends
        halves = [WorkUnit(tuple(files), span) for span in ((0, cut), (cut, len(body)))]
        assert [d for u in halves for d in read_documents(u, "text")] == docs, cut
    path.write_bytes(body + b'{"other": 1}\n')
    files, _ = expand_sources([str(path)])
    with pytest.raises(DataError, match=f"^{path}: the line at byte {len(body)}: no 'text' field"):
        list(read_documents(WorkUnit(tuple(files), (len(body) - 10, len(body) + 13)), "text"))


def test_max_source_bytes_cuts_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("0123456789")
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS[:4]))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS[4:8])))
    (tmp_path / "d.txt").write_text("after the budget")
    first_two = len(jsonl(DOCS[:2]))
    files, _ = expand_sources([str(tmp_path)], max_source_bytes=10 + first_two + 5)
    assert [(Path(f.url).name, f.limit) for f in files] == [("a.txt", 10), ("b.jsonl", first_two + 5)]
    units, _ = plan_units(files)
    assert [d for u in units for d in read_documents(u, "text")] == ["0123456789", *DOCS[:2]]  # partial line dropped
    files, _ = expand_sources([str(tmp_path)], max_source_bytes=10 + len(jsonl(DOCS[:4])) + 1)
    assert [(Path(f.url).name, f.limit == f.size) for f in files] == [
        ("a.txt", True), ("b.jsonl", True), ("c.jsonl.gz", True)]  # the gzip whole, though over budget
    files, _ = expand_sources([str(tmp_path)], max_source_bytes=4)
    assert [(Path(f.url).name, f.limit) for f in files] == [("a.txt", 4)]
    assert read_all([str(tmp_path / "a.txt")])[0] == ["0123456789"]


# ------------------------------------------------------------------- sources, storage, stability
def test_stdlib_globs_and_missing_paths(tmp_path: Path) -> None:
    files, bad = expand_sources(["stdlib"])
    root = sysconfig.get_paths()["stdlib"]
    assert bad == [] and len(files) > 500 and all(f.kind == "text" and f.limit == f.size for f in files)
    assert [f.url for f in files] == sorted(f.url for f in files) and f"{root}/this.py" in {f.url for f in files}
    this = next(f for f in files if f.url.endswith("/this.py"))
    assert list(read_documents(WorkUnit((this,)), "text")) == [Path(this.url).read_text()]
    (tmp_path / "x.txt").write_text("x")
    files, _ = expand_sources([str(tmp_path / "*.txt"), str(tmp_path / "x.txt")])  # one file, once
    assert [f.url for f in files] == [str(tmp_path / "x.txt")]
    with pytest.raises(DataError, match="the glob matches no file"):
        expand_sources([str(tmp_path / "*.none")])
    with pytest.raises(DataError, match="no such file or directory"):
        expand_sources([str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no data file"):
        expand_sources([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="on_bad_source 'ignore'"):
        expand_sources(["stdlib"], on_bad_source="ignore")


def test_memory_urls_and_deterministic_plans(tmp_path: Path) -> None:
    fs, root = fsspec.filesystem("memory"), f"memory://sources-{uuid.uuid4().hex}"
    table = tmp_path / "t.parquet"
    write_parquet(table, DOCS[10:20], row_group_size=3)
    try:
        fs.pipe(f"{root}/a.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl(DOCS[:10])))
        fs.pipe(f"{root}/b.parquet", table.read_bytes())
        fs.pipe(f"{root}/c.png", b"\x89PNG\r\n\x1a\n")  # not a data suffix: left out of the directory
        plans = []
        for _ in range(2):
            files, _ = expand_sources([root])
            units, _ = plan_units(files, target_bytes=1)
            plans.append(json.dumps([u.describe() for u in units], sort_keys=True))
        assert plans[0] == plans[1]
        assert [(f.url, f.kind) for f in files] == [(f"{root}/a.jsonl.zst", "jsonl"), (f"{root}/b.parquet", "parquet")]
        assert [u.part for u in units] == [None, (0, 1), (1, 2), (2, 3), (3, 4)]
        assert [d for u in units for d in read_documents(u, "text")] == DOCS[:20]
        with pytest.raises(DataError, match=f"^{root}/c.png: binary \\(PNG image\\)"):
            expand_sources([f"{root}/c.png"])
    finally:
        fs.rm(root, recursive=True)


def test_storage_outage_is_never_a_bad_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An outage mid-read is a StorageError even under "skip": dropping the file would make the
    corpus depend on the network."""
    from megatrain import storage
    from megatrain.data import source_formats

    path = write_parquet(tmp_path / "t.parquet", DOCS)
    units, _ = plan_units(expand_sources([str(path)])[0])

    class Flaky:
        def __init__(self, handle) -> None:
            self.handle, self.reads = handle, 0

        def read(self, size: int = -1) -> bytes:
            self.reads += 1
            if self.reads > 3:
                raise ConnectionResetError("connection reset by peer")
            return self.handle.read(size)

        def __getattr__(self, name: str):
            return getattr(self.handle, name)

    real_open = storage.open_url
    monkeypatch.setattr(source_formats.storage, "open_url", lambda url, mode="rb": Flaky(real_open(url, mode)))
    with pytest.raises(storage.StorageError, match="connection reset"):
        list(read_documents(units[0], "text", "skip", []))
