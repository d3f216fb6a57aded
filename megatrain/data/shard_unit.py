"""One work unit of sharding, anywhere: its documents -> tokens -> packed shards, content-addressed.

A unit (``sources.WorkUnit``: some small files, a file, a range of Parquet row groups, Arrow data
files, of the rows of one of them, or of JSONL bytes) is the grain every engine hands out: a process of the local pool, a Prefect task on a Dask
worker. It writes only below its own folder ``<version>/units/<unit id>/``:

    shard-NNNNNN.tar   its training windows (seq_len + 1 tokens each), ``samples_per_shard`` a shard
    tail.npy           the tokens left after its last full window (fewer than seq_len + 1)
    heldout.npy        the tokens of its held-out documents (data.val_fraction), not packed yet
    reserve.npy        its not-held-out documents of smallest hash, one window's worth: held out or
                       trained by the finish (held_out.py: every version gets a held-out split)
    unit.json          written last: what the files above hold, with their sha256, and per input
                       file its bytes that were not UTF-8 (``replaced_bytes``: decoding.py)

The unit id hashes the unit and every parameter that shapes its output, so a unit whose
``unit.json`` exists is done (a rerun skips it), and a unit killed midway, which has none, is
simply done again: nothing it left behind is read. ``shard.finish_sharding`` packs the tails and
the held-out tokens of all units, in unit order, and writes the index. The output is a function of
the unit alone, so every engine and worker count writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain import storage
from megatrain.data.held_out import Reserve, document_hash, is_held_out  # noqa: F401  (is_held_out: re-exported)
from megatrain.data.index import DataError
from megatrain.data.shard_format import write_shard
from megatrain.data.sources import BadSource, SourceFile, WorkUnit, read_documents
from megatrain.data.tokenizer import TokenizerSpec, machine_cores, use_cores

log = logging.getLogger(__name__)

UNIT_DONE = "unit.json"
ENCODE_CHARS = 4 << 20  # documents handed to the tokenizer at once (one encode_batch call)


@dataclass(frozen=True)
class ShardPlan:
    """Everything a worker needs to shard any unit of a version; written to ``<version>/plan.json``
    so a worker on another machine needs only that URL."""

    url: str  # the version directory
    version: str
    seq_len: int
    samples_per_shard: int
    dtype: str
    tokenizer_file: str  # inside the version directory
    tokenizer_sha256: str
    eos_id: int
    bos_id: int | None
    text_field: str
    val_fraction: float
    on_bad_source: str
    units: list[WorkUnit]
    bad_sources: list[BadSource]  # found while planning (under on_bad_source=skip)
    params: dict[str, Any]  # what names the version
    inputs: dict[str, Any]  # the fingerprinted input description
    # held_out.py's rule 2: each unit keeps a reserve, and the finish holds out enough of the
    # version's documents of smallest hash for one window (False in plans written before it)
    held_out_floor: bool = False
    # data.max_replaced_fraction (decoding.py): a file part with more bytes that are not UTF-8 is a
    # bad source; None in plans written before text decoding was counted (no limit then)
    max_replaced_fraction: float | None = None
    worker_cores: int = 0  # data.worker_cores: shapes no output, only a worker's threads (worker_cores())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("url")  # a plan may be read from anywhere the version is
        return out

    @classmethod
    def from_json(cls, url: str, raw: dict[str, Any]) -> ShardPlan:
        fields = dict(raw)
        fields["units"] = [unit_from_json(u) for u in raw["units"]]
        fields["bad_sources"] = [BadSource(**b) for b in raw["bad_sources"]]
        return cls(url=url, **fields)

    def unit_id(self, i: int) -> str:
        """A hash of unit ``i`` and of every parameter that shapes its output."""
        shaping = {k: getattr(self, k) for k in ("seq_len", "samples_per_shard", "dtype", "tokenizer_sha256", "eos_id",
                                                 "bos_id", "text_field", "val_fraction", "on_bad_source")}
        if self.held_out_floor:  # only then: a unit planned before it keeps its id
            shaping["held_out_floor"] = True
        if self.max_replaced_fraction is not None:  # likewise
            shaping["max_replaced_fraction"] = self.max_replaced_fraction
        blob = json.dumps({"unit": self.units[i].describe(), **shaping}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def unit_url(self, i: int) -> str:
        return storage.join_url(self.url, "units", self.unit_id(i))


def unit_from_json(raw: dict[str, Any]) -> WorkUnit:
    part, rows = raw.get("part"), raw.get("rows")
    return WorkUnit(files=tuple(SourceFile(**f) for f in raw["files"]), part=None if part is None else tuple(part),
                    size_hint=raw.get("size_hint"), rows=None if rows is None else tuple(rows))


_PLANS: dict[str, ShardPlan] = {}


def load_plan(url: str) -> ShardPlan:
    """The plan of the version at ``url`` (read once per process: every unit task of a worker reuses it)."""
    if url not in _PLANS:
        plan_url = storage.join_url(url, "plan.json")
        try:
            _PLANS[url] = ShardPlan.from_json(url, json.loads(storage.read_bytes(plan_url)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{plan_url}: not a sharding plan ({exc})") from exc
    return _PLANS[url]


def _tokenizer(plan: ShardPlan) -> TokenizerSpec:
    url = storage.confined(plan.url, plan.tokenizer_file, storage.join_url(plan.url, "plan.json"))
    raw = storage.read_bytes(url)
    if hashlib.sha256(raw).hexdigest() != plan.tokenizer_sha256:
        raise DataError(f"{url}: not the tokenizer this version was planned with (sha256 differs)")
    return TokenizerSpec(raw.decode(), plan.tokenizer_sha256, plan.eos_id, plan.bos_id, url)


def _batches(documents, limit: int = ENCODE_CHARS):
    """Documents in lists of about ``limit`` characters: one tokenizer call each."""
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += len(document)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _save_npy(url: str, tokens: np.ndarray) -> dict[str, Any]:
    buffer = io.BytesIO()
    np.save(buffer, tokens, allow_pickle=False)
    data = buffer.getvalue()
    storage.write_bytes(url, data)
    return {"name": url.rsplit("/", 1)[-1], "tokens": int(len(tokens)), "sha256": hashlib.sha256(data).hexdigest()}


def load_npy(unit_url: str, record: dict[str, Any], source: str) -> np.ndarray:
    """A unit's tail.npy / heldout.npy, checked against its record in unit.json."""
    url = storage.confined(unit_url, record["name"], source)
    data = storage.read_bytes(url)
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise DataError(f"{url}: sha256 does not match {source} (corrupt or replaced)")
    return np.load(io.BytesIO(data), allow_pickle=False)


class _UnitWriter:
    """Packs a unit's training tokens into windows and writes full shards as they fill."""

    def __init__(self, plan: ShardPlan, unit_url: str) -> None:
        self.plan, self.unit_url = plan, unit_url
        self.window = plan.seq_len + 1
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict[str, Any]] = []
        self.samples = 0

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        shard_tokens = self.plan.samples_per_shard * self.window
        while self.pending_tokens >= shard_tokens:
            joined = np.concatenate(self.pending)
            self._write(joined[:shard_tokens].reshape(-1, self.window))
            rest = joined[shard_tokens:]
            self.pending, self.pending_tokens = [rest], len(rest)

    def _write(self, windows: np.ndarray) -> None:
        url = storage.join_url(self.unit_url, f"shard-{len(self.shards):06d}.tar")
        info = write_shard(url, windows, self.samples)
        self.shards.append(dataclasses.asdict(info))
        self.samples += len(windows)

    def close(self) -> np.ndarray:
        """Write the last, short shard; return the tail (fewer tokens than one window)."""
        joined = np.concatenate(self.pending) if self.pending else np.empty(0, self.plan.dtype)
        full = len(joined) // self.window * self.window
        if full:
            self._write(joined[:full].reshape(-1, self.window))
        return joined[full:]


def _flat(documents: list[list[int]], dtype: np.dtype) -> np.ndarray:
    count = sum(map(len, documents))
    return np.fromiter(itertools.chain.from_iterable(documents), dtype=dtype, count=count)


def shard_unit(plan: ShardPlan, i: int) -> dict[str, Any]:
    """Shard unit ``i`` of ``plan`` (nothing to do when its unit.json exists); returns unit.json."""
    unit, unit_url = plan.units[i], plan.unit_url(i)
    done_url = storage.join_url(unit_url, UNIT_DONE)
    if storage.exists(done_url):
        return read_unit(plan, i)
    tokenizer = _tokenizer(plan)
    dtype = np.dtype(plan.dtype)
    writer, held_out, bad = _UnitWriter(plan, unit_url), [], []
    reserve = Reserve(plan.seq_len + 1) if plan.held_out_floor else None
    threshold = plan.val_fraction * 2**64  # held_out.is_held_out's rule, on a hash computed once
    documents = tokens = 0
    replaced: dict[str, int] = {}  # per file: bytes that were not UTF-8, now U+FFFD (decoding.py)
    for batch in _batches(read_documents(unit, plan.text_field, plan.on_bad_source, bad, replaced,
                                         plan.max_replaced_fraction)):
        train: list[list[int]] = []
        for document, ids in zip(batch, tokenizer.encode_documents(batch)):
            digest = document_hash(document) if plan.val_fraction > 0 else 0
            if plan.val_fraction > 0 and digest < threshold:
                held_out.append(ids)
            elif reserve is not None:
                train += reserve.offer(digest, ids)  # what leaves the reserve trains
            else:
                train.append(ids)
            documents, tokens = documents + 1, tokens + len(ids)
        if train:
            writer.add(_flat(train, dtype))
    tail = writer.close()
    heldout = _flat(held_out, dtype)
    record = {
        "unit_id": plan.unit_id(i), "unit": unit.describe(), "documents": documents, "tokens": tokens,
        "shards": writer.shards, "tail": _save_npy(storage.join_url(unit_url, "tail.npy"), tail),
        "heldout": _save_npy(storage.join_url(unit_url, "heldout.npy"), heldout),
        "bad_sources": [dataclasses.asdict(b) for b in bad], "replaced_bytes": replaced,
    }
    if reserve is not None:
        kept = reserve.documents()
        record["heldout_documents"] = len(held_out)
        record["reserve"] = {**_save_npy(storage.join_url(unit_url, "reserve.npy"), _flat([ids for _, ids in kept], dtype)),
                             "documents": [[f"{digest:016x}", len(ids)] for digest, ids in kept]}
    storage.write_bytes(done_url, json.dumps(record, indent=1, sort_keys=True).encode())  # last: the unit is done
    log.info("unit %d/%d: %d documents, %d tokens, %d samples -> %s", i + 1, len(plan.units), documents, tokens,
             writer.samples, unit_url)
    return record


WORKER_CORES_ENV = "MEGATRAIN_WORKER_CORES"  # the cores an engine gives the worker process it starts
_GIVEN: list[int] = []  # the cores this worker process's tokenizer was set to, once


def worker_cores(setting: int) -> int | None:
    """The cores this worker process is given: ``data.worker_cores`` when set; else what the engine
    that started it said ($MEGATRAIN_WORKER_CORES: the local pool, the flow's LocalCluster); else,
    on a Dask worker, the machine's cores over the worker's task threads (one worker process per
    machine, as a deployment starts them: several per machine need data.worker_cores). None: not
    a worker process (a unit sharded inline), whose threads are the caller's business."""
    if setting > 0:
        return setting
    if os.environ.get(WORKER_CORES_ENV, "").isdigit():
        return max(1, int(os.environ[WORKER_CORES_ENV]))
    if "distributed" in sys.modules:
        from distributed import get_worker

        try:
            threads = get_worker().state.nthreads
        except ValueError:  # not inside a Dask worker
            return None
        return max(1, machine_cores() // max(1, threads))
    return None


def shard_unit_on_worker(plan_url: str, i: int) -> dict[str, Any]:
    """Unit ``i`` of the version at ``plan_url`` in an engine's worker process (a Dask task): the
    tokenizer's threads are set from the cores the worker is given before its first unit, then
    ``shard_unit``."""
    plan = load_plan(plan_url)
    if not _GIVEN:
        cores = worker_cores(plan.worker_cores)
        if cores is not None:
            use_cores(cores)
            log.info("sharding worker %d: %d core%s, so %d tokenizer thread%s", os.getpid(), cores,
                     "" if cores == 1 else "s", cores, "" if cores == 1 else "s")
        _GIVEN.append(cores or 0)
    return shard_unit(plan, i)


def read_unit(plan: ShardPlan, i: int) -> dict[str, Any]:
    """Unit ``i``'s unit.json; a unit without one has not finished (its task must run again)."""
    done_url = storage.join_url(plan.unit_url(i), UNIT_DONE)
    if not storage.exists(done_url):
        raise DataError(f"unit {i} of {plan.url} ({plan.unit_url(i)}) has not finished: run its shard task again")
    try:
        record = json.loads(storage.read_bytes(done_url))
    except json.JSONDecodeError as exc:
        raise DataError(f"{done_url}: not valid JSON ({exc})") from exc
    if record.get("unit_id") != plan.unit_id(i):
        raise DataError(f"{done_url}: written for another unit ({record.get('unit_id')}, expected {plan.unit_id(i)})")
    return record
