"""Corpus sources -> typed files -> work units -> documents.

The steps, in order, are the functions of this module:

1. ``expand_sources``: paths, globs, URLs, directories and ``stdlib`` -> the sorted, de-duplicated
   files, each identified by its CONTENT (``source_formats.identify``): text, JSONL (plain, gzip or
   zstd), Parquet, or a ``datasets`` Arrow folder; cut at ``max_source_bytes``. Anything else is
   refused here, before anything is written.
2. ``plan_units``: files -> work units of about ``target_bytes``: small text/JSONL files grouped, a
   Parquet file cut by row groups, an Arrow folder by data files, and a row group or data file much
   larger than a unit by row ranges (``tabular_units.py``), a large uncompressed JSONL by byte
   ranges. Reads metadata only (footers, state.json, Arrow message headers), never the data.
3. ``read_documents``: one unit -> its documents (str), always in the same order; bytes that are
   not UTF-8 counted per file (``decoding.py``).

``on_bad_source``: under ``"error"`` the first refused or broken file raises its DataError; under
``"skip"`` it is logged, left out, and returned as a ``BadSource`` so the index can record it. A
StorageError (an outage) always raises: skipping on it would make the corpus depend on the weather.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeVar

from megatrain import storage
from megatrain.data import decoding
from megatrain.data import source_formats as formats
from megatrain.data import table_formats as tables
from megatrain.data.decoding import Tally
from megatrain.data.index import DataError
from megatrain.data.tabular_units import tabular_units
from megatrain.errors import UnsafePathError

log = logging.getLogger(__name__)
T = TypeVar("T")

SourceKind = Literal["text", "jsonl", "parquet", "arrow"]
DATA_SUFFIXES = tuple(kind + compression for kind in (*formats.TEXT_SUFFIXES, *formats.JSONL_SUFFIXES, ".parquet")
                      for compression in ("", *formats.COMPRESSION_SUFFIXES))  # what a directory contributes
ARROW_MARKERS = ("state.json", "dataset_info.json")  # a folder holding both was written by save_to_disk
HOLD_BYTES = 64 << 20  # under "skip", a file part up to this is held in memory; a larger one is read twice
POLICIES = ("error", "skip")


@dataclass(frozen=True)
class SourceFile:
    url: str  # a file, or an Arrow dataset folder
    kind: SourceKind
    compression: str | None  # None, "gzip" or "zstd" (text and jsonl only)
    size: int  # bytes on storage (an Arrow folder: the sum of its data files)
    mtime: str  # change marker (mtime, ETag, ...), "" when none
    limit: int  # bytes to read: == size unless max_source_bytes cut an uncompressed text/jsonl file


@dataclass(frozen=True)
class BadSource:
    url: str
    reason: str  # the one-line reason (what the file looks like)


@dataclass(frozen=True)
class WorkUnit:
    files: tuple[SourceFile, ...]  # several small text/jsonl files grouped, or one file
    part: tuple[int, int] | None = None  # parquet: row groups [first, stop); arrow: data files
    # [first, stop); uncompressed jsonl: bytes [start, stop) (a line belongs to the range it starts in)
    size_hint: int | None = field(default=None, compare=False)  # plan_units' estimate of ``bytes``
    rows: tuple[int, int] | None = None  # a cut row group or Arrow data file (part: that one): its rows [first, stop)

    def describe(self) -> dict[str, Any]:
        """JSON-able and stable: it content-addresses the unit's output."""
        described = {"files": [asdict(f) for f in self.files], "part": list(self.part) if self.part else None}
        if self.rows is not None:  # only then: a unit of whole pieces keeps the id it always had
            described["rows"] = list(self.rows)
        return described

    @property
    def bytes(self) -> int:
        """Estimated input bytes (balancing and progress)."""
        if self.size_hint is not None:
            return self.size_hint
        if self.part is not None and self.files[0].kind == "jsonl":
            return self.part[1] - self.part[0]
        return sum(f.limit for f in self.files)


# ------------------------------------------------------------------------------------ 1. files
def expand_sources(sources: list[str], max_source_bytes: int | None = None,
                   on_bad_source: str = "error") -> tuple[list[SourceFile], list[BadSource]]:
    """Sources -> (the files to read in sorted URL order, the files refused under "skip").

    ``max_source_bytes`` stops reading after that many bytes in that order: an uncompressed text or
    JSONL file may be cut; compressed, Parquet and Arrow sources are whole while budget remains.
    Refused files take no budget, and files past the budget are not even looked at.
    """
    _check_policy(on_bad_source)
    found: dict[str, tuple[dict, str | None]] = {}  # url -> (storage info, kind known without looking)
    for source in sources:
        found.update(_expand(source))
    urls = sorted(found)
    files: list[SourceFile] = []
    bad: list[BadSource] = []
    budget = max_source_bytes
    for url, outcome in zip(urls, _each(lambda u: _identify(u, *found[u]), urls)):
        if budget is not None and budget <= 0:
            break
        if isinstance(outcome, BaseException):
            _refused(url, outcome, on_bad_source, bad)
            continue
        whole = outcome.compression is not None or outcome.kind in ("parquet", "arrow")
        limit = outcome.size if budget is None or whole else min(outcome.size, budget)
        files.append(replace(outcome, limit=limit))
        budget = None if budget is None else budget - limit
    return files, bad


def _expand(source: str) -> dict[str, tuple[dict, str | None]]:
    """One source -> {url: (info, kind hint)}; a missing path or a glob without matches is an error."""
    if source == "stdlib":  # the standard library's own .py files: known text, not sniffed
        return {path: (info, "text") for path, info in _stdlib_files().items()}
    if any(ch in source for ch in "*?["):
        found = storage.glob(source)
        if not found:
            raise DataError(f"source {source!r}: the glob matches no file")
        return {url: (info, None) for url, info in found.items()}
    if not storage.exists(source):
        raise DataError(f"source {source!r}: no such file or directory")
    details = storage.info(source)
    if details.get("type") != "directory":
        return {source: (details, None)}
    if all(storage.exists(storage.join_url(source, name)) for name in ARROW_MARKERS):
        return {source: ({}, "arrow")}
    found = _directory(storage.find(source))
    if not found:
        raise DataError(f"source {source!r}: the directory holds no data file ({' '.join(DATA_SUFFIXES)}) "
                        f"and no Arrow dataset folder")
    return found


def _directory(listed: dict[str, dict]) -> dict[str, tuple[dict, str | None]]:
    """The files below a directory with a data suffix, and the Arrow dataset folders below it
    (each one source; the files inside them and a DatasetDict's dataset_dict.json are no data)."""
    folders = sorted({storage.parent_url(url) for url in listed if url.endswith("/" + ARROW_MARKERS[0])
                      and storage.join_url(storage.parent_url(url), ARROW_MARKERS[1]) in listed})
    found: dict[str, tuple[dict, str | None]] = {folder: ({}, "arrow") for folder in folders}
    for url, info in listed.items():
        inside = any(url.startswith(folder + "/") for folder in folders)
        if url.endswith(DATA_SUFFIXES) and not inside and not url.endswith("/dataset_dict.json"):
            found[url] = (info, None)
    return found


def _stdlib_files() -> dict[str, dict]:
    """The standard library's .py files (not the site-packages installed inside it)."""
    root = sysconfig.get_paths()["stdlib"]
    found = {}
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                found[path] = {"size": stat.st_size, "mtime": stat.st_mtime}
    return found


def _identify(url: str, info: dict, hint: str | None) -> SourceFile:
    if hint == "arrow":
        return _arrow_folder(url)
    size, mtime = int(info.get("size") or 0), _change_marker(info)
    # The standard library holds a few latin-1 and KOI8-R test files that the undecodable-text
    # rule would refuse; it has always been read as text with replacement characters.
    kind, compression = ("text", None) if hint == "text" else formats.identify(url, size)
    return SourceFile(url, kind, compression, size, mtime, size)  # type: ignore[arg-type]


def _arrow_folder(folder: str) -> SourceFile:
    """An Arrow dataset folder: its size is its data files'; its change marker a hash of theirs."""
    data = tables.arrow_data_files(folder)
    infos = [storage.info(storage.join_url(folder, "state.json"))] + [tables.arrow_data_info(url) for url in data]
    markers = [[int(info.get("size") or 0), _change_marker(info)] for info in infos]
    size = sum(size for size, _ in markers[1:])
    return SourceFile(folder, "arrow", None, size, hashlib.sha256(json.dumps(markers).encode()).hexdigest()[:16], size)


def _change_marker(info: dict) -> str:
    for key in ("mtime", "modificationTime", "LastModified", "ETag", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


# ------------------------------------------------------------------------------------ 2. units
def plan_units(files: list[SourceFile], target_bytes: int = 64 << 20, group_bytes: int = 1 << 20,
               on_bad_source: str = "error", text_field: str | None = None) -> tuple[list[WorkUnit], list[BadSource]]:
    """Files -> (work units in file order, the files refused under "skip").

    Text and JSONL files under ``group_bytes`` are grouped up to ``group_bytes`` per unit (a unit per
    small file would cost more in IPC than in work). A Parquet file is cut by row groups (their
    compressed sizes, from the footer) and an Arrow folder by data files into units of about
    ``target_bytes``, a piece much larger than that into row ranges (``tabular_units.py``); an
    uncompressed JSONL above ``target_bytes`` into byte ranges; any other file,
    compressed ones included, is one unit. With ``text_field`` the Parquet and Arrow text column is
    checked now, from the metadata, rather than when the unit is read.
    """
    _check_policy(on_bad_source)
    if target_bytes <= 0 or group_bytes <= 0:
        raise ValueError(f"target_bytes {target_bytes} and group_bytes {group_bytes} must be positive")
    tabular = [f for f in files if f.kind in ("parquet", "arrow")]
    pieces = dict(zip((f.url for f in tabular),
                      _each(lambda f: tabular_units(f, text_field, target_bytes, group_bytes), tabular)))
    units: list[WorkUnit] = []
    bad: list[BadSource] = []
    group: list[SourceFile] = []

    def close_group() -> None:
        if group:
            units.append(WorkUnit(tuple(group)))
            group.clear()

    for file in files:
        if file.kind in ("text", "jsonl") and file.limit < group_bytes:
            group.append(file)
            if sum(f.limit for f in group) >= group_bytes:
                close_group()
            continue
        close_group()
        cut = pieces.get(file.url)
        if isinstance(cut, BaseException):
            _refused(file.url, cut, on_bad_source, bad)
        elif cut is not None:
            units += [WorkUnit((file,), part, weight, rows) for part, weight, rows in cut]
        elif file.kind == "jsonl" and file.compression is None and file.limit > target_bytes:
            units += [WorkUnit((file,), (start, min(start + target_bytes, file.limit)))
                      for start in range(0, file.limit, target_bytes)]
        else:
            units.append(WorkUnit((file,)))
    close_group()
    return units, bad


# -------------------------------------------------------------------------------- 3. documents
def read_documents(unit: WorkUnit, text_field: str, on_bad_source: str = "error",
                   bad: list[BadSource] | None = None, replaced: dict[str, int] | None = None,
                   max_replaced_fraction: float | None = None) -> Iterator[str]:
    """The unit's documents, file by file, in a fixed order.

    Under "skip" a file that fails midway is appended to ``bad`` and contributes nothing: each
    file's part is read completely before any of its documents is yielded (held in memory up to
    HOLD_BYTES of input, else read once to the end and then again), so what is kept never depends
    on where the failure happened. The unit of skipping is the unit's part of a file: the other
    row groups, data files or byte ranges of a cut file are units of their own.
    Under "error" documents stream as they are read and the failure raises.

    Text decoding is counted (decoding.py): each file's bytes that were not UTF-8 are added to
    ``replaced[url]`` once the file's part is read; a part above ``max_replaced_fraction`` of
    its bytes fails like a broken file (under "error", after its documents streamed).
    """
    _check_policy(on_bad_source)
    for file in unit.files:
        def documents(tally: Tally, file: SourceFile = file) -> Iterator[str]:
            yield from _documents(file, unit.part, unit.rows, text_field, tally)
            decoding.check(file.url, tally, max_replaced_fraction)

        if on_bad_source == "error":
            tally = Tally()
            yield from documents(tally)
            _count(replaced, file.url, tally)
            continue
        weight = (unit.bytes if len(unit.files) == 1 else file.limit) * (4 if file.compression else 1)
        tally = Tally()
        try:
            if weight <= HOLD_BYTES:
                held: Iterator[str] = iter(list(documents(tally)))
            else:
                for _ in documents(Tally()):  # read through once: a huge file is read twice, not held
                    pass
                held = documents(tally)
        except (DataError, UnsafePathError) as exc:
            _refused(file.url, exc, on_bad_source, bad if bad is not None else [])
            continue
        yield from held
        _count(replaced, file.url, tally)


def _count(replaced: dict[str, int] | None, url: str, tally: Tally) -> None:
    if replaced is not None and tally.replaced:
        replaced[url] = replaced.get(url, 0) + tally.replaced


def _documents(file: SourceFile, part: tuple[int, int] | None, rows: tuple[int, int] | None, text_field: str,
               tally: Tally) -> Iterator[str]:
    if file.kind == "text":
        return iter(formats.text_documents(file.url, file.compression, file.limit, tally))
    if file.kind == "jsonl":
        return formats.jsonl_documents(file.url, file.compression, file.limit, text_field, part, tally)
    if file.kind == "parquet":
        return tables.parquet_documents(file.url, text_field, part, rows)
    data = tables.arrow_data_files(file.url)
    if rows is not None:
        return tables.arrow_rows(data[part[0]], text_field, rows)
    return tables.arrow_documents(data[slice(*part)] if part else data, text_field)


# ------------------------------------------------------------------------------------ helpers
def _check_policy(on_bad_source: str) -> None:
    if on_bad_source not in POLICIES:
        raise ValueError(f"on_bad_source {on_bad_source!r}: must be one of {', '.join(POLICIES)}")


def _refused(url: str, exc: BaseException, on_bad_source: str, bad: list[BadSource]) -> None:
    """Raise a bad file's error ("error"), or log and count it ("skip"); anything else always raises."""
    if on_bad_source == "error" or not isinstance(exc, (DataError, UnsafePathError)):
        raise exc
    reason = str(exc).splitlines()[0].removeprefix(f"{url}: ")
    log.warning("skipping %s: %s", url, reason)
    bad.append(BadSource(url, reason))


def _each(fn: Callable[[T], Any], items: list[T], threads: int = 16) -> Iterator[Any]:
    """``fn(item)`` for each item in order, as its result or the exception it raised. Planning reads
    a little from many files, a round trip each on an object store: 16 run at once, a batch at a
    time, so a caller that stops early (max_source_bytes) has read little beyond."""
    def outcome(item: T) -> Any:
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises or skips in file order
            return exc

    if len(items) <= 1:
        yield from map(outcome, items)
        return
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(items), 4 * threads):
            yield from pool.map(outcome, items[start:start + 4 * threads])
