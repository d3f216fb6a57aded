"""A corpus -> tokenized, packed webdataset shards with an index, in units any engine can run.

Three steps, each a function here, so an engine needs only to call them:

1. ``plan_sharding``: the sources become typed files and work units (``sources.py``: text, JSONL
   plain or compressed, Parquet row groups, Arrow folders; anything else refused before a byte is
   written); a hash of the files and of the parameters names the version directory; the
   tokenizer is trained or loaded (``tokenizer.py``) and written there, with ``plan.json``. An
   existing, complete version is returned as it is: sharding twice does nothing.
2. ``shard_unit(plan, i)`` for every unit, in any order, on any machine (``shard_unit.py``): each
   writes its own shards below ``units/<unit id>/`` and a ``unit.json`` last.
3. ``finish_sharding``: the units' leftover tails and held-out tokens, in unit order, become the
   version's own shards; ``index.json`` is written last, so a version with an index is complete.

Engines: ``shard_corpus`` (one corpus) and ``shard_corpora`` (a mixture's components) run all
three here, the units on one local process pool (``local_engine.py``: ``megatrain shard``, the
trainer, the flow's local engine); the ``shard-data`` flow maps the units as Prefect tasks,
on a Dask cluster with ``data.engine: dask``. A unit's output depends on the unit alone, so every
engine and worker count writes a bit-identical index. Every byte goes through
``megatrain.storage``: input and output may be any URL.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
from collections.abc import Iterator

import numpy as np

from megatrain import storage
from megatrain.config import DataConfig
from megatrain.data.index import (
    FORMAT, INDEX_NAME, TOKENIZER_NAME, BadShardError, DataError, ShardIndex, ShardInfo, describe_replaced,
    dtype_for_vocab, load_index, write_index,
)
from megatrain.data.legacy import legacy_version
from megatrain.data.held_out import FLOOR, ReservedDocument, choose_floor
from megatrain.data.shard_format import write_shard
from megatrain.data.local_engine import run_units
from megatrain.data.shard_unit import ShardPlan, is_held_out, load_npy, read_unit, shard_unit
from megatrain.data.sources import SourceFile, expand_sources, plan_units, read_documents
from megatrain.data.tokenizer import TokenizerSpec, load_tokenizer, machine_cores, train_bpe

__all__ = ["BadShardError", "DataError", "ShardIndex", "ShardInfo", "cli", "finish_sharding", "is_held_out",
           "load_index", "plan_sharding", "shard_corpus", "shard_unit"]

log = logging.getLogger(__name__)

GROUP_BYTES = 1 << 20  # small files are grouped into units of about this many bytes (or data.unit_bytes if less)
UNITS_PER_VERSION = 16  # a corpus is cut into at least this many units when it is large enough (unit_target)
UNIT_PLAN = 2  # the version's params name it: 2 = unit_target's grain, large pieces cut by rows, decoding counted


def fingerprint(files: list[SourceFile], params: dict) -> str:
    """A short hash naming the version: same inputs and parameters -> same version directory."""
    described = [[f.url, f.kind, f.compression, f.size, f.mtime, f.limit] for f in files]
    blob = json.dumps({"files": described, "params": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _existing(url: str, vocab_size: int) -> ShardIndex | None:
    if not storage.exists(storage.join_url(url, INDEX_NAME)):
        return None
    index = load_index(url)
    if index.vocab_size > vocab_size:
        raise DataError(f"{url}: tokenizer vocabulary {index.vocab_size} exceeds the model's {vocab_size}")
    log.info("shards %s already exist: nothing to do", url)
    return index


def _tokenizer(cfg: DataConfig, units, vocab_size: int) -> TokenizerSpec:
    if cfg.tokenizer != "bpe":
        return load_tokenizer(cfg.tokenizer, cfg.eos_token, vocab_size)
    documents = (doc for unit in units for doc in read_documents(unit, cfg.text_field, cfg.on_bad_source, [],
                                                                 max_replaced_fraction=cfg.max_replaced_fraction))
    return train_bpe(documents, min(cfg.bpe_vocab_size or vocab_size, vocab_size), cfg.eos_token)


def plan_sharding(cfg: DataConfig, seq_len: int, vocab_size: int) -> ShardPlan | ShardIndex:
    """The plan of this corpus's version, written beside it; or its index when the version exists."""
    files, bad = expand_sources(cfg.sources, cfg.max_source_bytes, cfg.on_bad_source)
    if not files or sum(f.limit for f in files) == 0:
        raise DataError(f"sources {cfg.sources}: the corpus is empty" + (f" ({len(bad)} refused)" if bad else ""))
    old = legacy_version(cfg, files, seq_len, vocab_size)  # a version written before format 2 still serves
    if old is not None and (index := _existing(storage.join_url(cfg.shard_url, old), vocab_size)) is not None:
        return index
    tokenizer_sha = "" if cfg.tokenizer == "bpe" else _file_sha256(cfg.tokenizer)
    params = {
        "format": FORMAT, "seq_len": seq_len, "samples_per_shard": cfg.samples_per_shard, "tokenizer": cfg.tokenizer,
        "tokenizer_sha256": tokenizer_sha, "eos_token": cfg.eos_token, "text_field": cfg.text_field,
        "max_source_bytes": cfg.max_source_bytes, "unit_bytes": cfg.unit_bytes, "group_bytes": _group_bytes(cfg),
        "on_bad_source": cfg.on_bad_source,
        # only what changes the output: a model that grows its padded vocab keeps the same shards
        "bpe_vocab_size": min(cfg.bpe_vocab_size or vocab_size, vocab_size) if cfg.tokenizer == "bpe" else None,
    }
    if cfg.val_fraction:
        params["val_fraction"] = cfg.val_fraction
        # a version sharded before every version got a held-out floor keeps its name (and so the
        # data position of the checkpoints trained on it); a new one follows held_out.py's rule 2
        before_floor = fingerprint(files, params)
        if (index := _existing(storage.join_url(cfg.shard_url, before_floor), vocab_size)) is not None:
            return index
        params["held_out_floor"] = FLOOR
    # likewise a version sharded before text decoding was counted and large pieces were cut by rows
    if (index := _existing(storage.join_url(cfg.shard_url, fingerprint(files, params)), vocab_size)) is not None:
        return index
    params.update(max_replaced_fraction=cfg.max_replaced_fraction, unit_plan=UNIT_PLAN)
    version = fingerprint(files, params)
    url = storage.join_url(cfg.shard_url, version)
    if (index := _existing(url, vocab_size)) is not None:
        return index
    units, unreadable = plan_units(files, unit_target(cfg, files), _group_bytes(cfg), cfg.on_bad_source,
                                   text_field=cfg.text_field)
    if not units:
        raise DataError(f"sources {cfg.sources}: no readable input ({len(bad) + len(unreadable)} files refused)")
    tokenizer = _tokenizer(cfg, units, vocab_size)
    storage.write_bytes(storage.join_url(url, TOKENIZER_NAME), tokenizer.json_text.encode())
    plan = ShardPlan(
        url=url, version=version, seq_len=seq_len, samples_per_shard=cfg.samples_per_shard,
        dtype=dtype_for_vocab(tokenizer.vocab_size), tokenizer_file=TOKENIZER_NAME,
        tokenizer_sha256=hashlib.sha256(tokenizer.json_text.encode()).hexdigest(), eos_id=tokenizer.eos_id,
        bos_id=tokenizer.bos_id, text_field=cfg.text_field, val_fraction=cfg.val_fraction,
        on_bad_source=cfg.on_bad_source, units=units, bad_sources=[*bad, *unreadable], params=params,
        inputs={"files": [dataclasses.asdict(f) for f in files], "bytes": sum(f.limit for f in files)},
        held_out_floor=bool(cfg.val_fraction), max_replaced_fraction=cfg.max_replaced_fraction,
        worker_cores=cfg.worker_cores,
    )
    storage.write_bytes(storage.join_url(url, "plan.json"), json.dumps(plan.to_json(), sort_keys=True).encode())
    log.info("planned %s: %d files (%d bytes) in %d units, %d sources refused", url, len(files),
             plan.inputs["bytes"], len(units), len(plan.bad_sources))
    return plan


def _group_bytes(cfg: DataConfig) -> int:
    return min(GROUP_BYTES, cfg.unit_bytes)


def unit_target(cfg: DataConfig, files: list[SourceFile]) -> int:
    """The bytes of a work unit: ``data.unit_bytes``, or less for a corpus too small to give
    UNITS_PER_VERSION units of that size (but never under GROUP_BYTES): a 20 MB corpus is 16
    units, not one that a single worker shards while the others wait. It depends on the files
    alone, never on the worker count, so every engine cuts the same units."""
    return min(cfg.unit_bytes, max(_group_bytes(cfg), sum(f.limit for f in files) // UNITS_PER_VERSION))


def _file_sha256(url: str) -> str:
    """data.tokenizer's identity for the version name: its tokenizer.json's bytes."""
    if storage.exists(url) and storage.info(url).get("type") == "directory":
        url = storage.join_url(url, TOKENIZER_NAME)
    if not storage.exists(url):
        raise DataError(f"data.tokenizer {url}: no such file or folder")
    return hashlib.sha256(storage.read_bytes(url)).hexdigest()


def _pack(plan: ShardPlan, tokens: np.ndarray, prefix: str) -> list[ShardInfo]:
    """Flat tokens -> windows -> shards ``<prefix>-NNNNNN.tar`` at the version root (tail dropped)."""
    window = plan.seq_len + 1
    windows = tokens[: len(tokens) // window * window].reshape(-1, window)
    shards = []
    for start in range(0, len(windows), plan.samples_per_shard):
        url = storage.join_url(plan.url, f"{prefix}-{len(shards):06d}.tar")
        shards.append(write_shard(url, windows[start:start + plan.samples_per_shard], start))
    return shards


def finish_sharding(plan: ShardPlan) -> ShardIndex:
    """Every unit done -> the version's index (written last). The units' tails are packed into
    ``tail-shard-*`` and their held-out documents into ``val-shard-*``, in unit order; with a
    held-out floor (held_out.py) the reserves are split between the two first."""
    shards, tails, held_out, records, bad = [], [], [], [], [dataclasses.asdict(b) for b in plan.bad_sources]
    replaced: dict[str, int] = {}
    for i in range(len(plan.units)):
        record, unit_url = read_unit(plan, i), plan.unit_url(i)
        source = storage.join_url(unit_url, "unit.json")
        prefix = unit_url[len(plan.url):].strip("/")
        for info in record["shards"]:
            storage.confined(unit_url, info["name"], source)  # a name from unit.json stays in its folder
            shards.append(ShardInfo(**{**info, "name": f"{prefix}/{info['name']}"}))
        tails.append([load_npy(unit_url, record["tail"], source)])
        held_out.append([load_npy(unit_url, record["heldout"], source)])
        records.append(record)
        bad += record["bad_sources"]
        for file_url, count in record.get("replaced_bytes", {}).items():  # a cut file: the sum of its units
            replaced[file_url] = replaced.get(file_url, 0) + count
    dtype = np.dtype(plan.dtype)
    val_documents, val_note = (_apply_floor(plan, records, tails, held_out, shards) if plan.held_out_floor
                               else (None, ""))
    shards += _pack(plan, np.concatenate([t for unit in tails for t in unit] or [np.empty(0, dtype)]), "tail-shard")
    val_shards = _pack(plan, np.concatenate([h for unit in held_out for h in unit] or [np.empty(0, dtype)]), "val-shard")
    if not shards:
        raise DataError(f"{plan.url}: the corpus has fewer than {plan.seq_len + 1} tokens, not one sample")
    num_samples = sum(s.num_samples for s in shards)
    index = ShardIndex(
        url=plan.url, version=plan.version, seq_len=plan.seq_len, vocab_size=_vocab_size(plan), eos_id=plan.eos_id,
        dtype=plan.dtype, num_samples=num_samples, num_tokens=num_samples * (plan.seq_len + 1), shards=shards,
        tokenizer_file=plan.tokenizer_file, tokenizer_sha256=plan.tokenizer_sha256, inputs=plan.inputs,
        params=plan.params, val_shards=val_shards, bad_sources=bad, bos_id=plan.bos_id,
        val_documents=val_documents, val_note=val_note, replaced_bytes=dict(sorted(replaced.items())),
    )
    write_index(index)
    log.info("wrote %d samples in %d shards (+ %d held-out samples, %d sources refused) to %s", num_samples,
             len(shards), index.val_num_samples, len(bad), plan.url)
    if val_note:
        log.warning("held-out split of %s: %s", plan.url, val_note)
    if replaced:
        log.warning("%s: %s", plan.url, describe_replaced(index.replaced_bytes))
    return index


def _apply_floor(plan: ShardPlan, records: list[dict], tails: list[list[np.ndarray]],
                 held_out: list[list[np.ndarray]], shards: list[ShardInfo]) -> tuple[int, str]:
    """held_out.py's rule 2: each unit's reserved documents join its held-out tokens (those the
    floor takes) or its tail (the rest), in hash order; without a split, rule 1's held-out
    tokens train too. Returns the version's held-out documents and its note."""
    window = plan.seq_len + 1
    reserves, reserved = [], []
    for i, record in enumerate(records):
        unit_url = plan.unit_url(i)
        tokens = load_npy(unit_url, record["reserve"], storage.join_url(unit_url, "unit.json"))
        lengths = [n for _, n in record["reserve"]["documents"]]
        reserves.append(np.split(tokens, np.cumsum(lengths)[:-1]) if lengths else [])
        reserved += [ReservedDocument(i, j, int(digest, 16), n)
                     for j, (digest, n) in enumerate(record["reserve"]["documents"])]
    held_tokens = sum(len(h) for unit in held_out for h in unit)
    train_tokens = (sum(s.num_samples for s in shards) * window + sum(len(t) for unit in tails for t in unit)
                    + sum(d.tokens for d in reserved))
    choice = choose_floor(reserved, sum(r["heldout_documents"] for r in records), held_tokens, train_tokens,
                          sum(r["documents"] for r in records), window, plan.val_fraction)
    for i, documents in enumerate(reserves):
        for j, ids in enumerate(documents):
            (held_out if (i, j) in choice.taken else tails)[i].append(ids)
        if not choice.split:  # no window to validate on: the few held-out documents train instead
            tails[i] += held_out[i]
            held_out[i] = []
    return choice.documents, choice.note


def _vocab_size(plan: ShardPlan) -> int:
    from megatrain.data.tokenizer import parse

    url = storage.join_url(plan.url, plan.tokenizer_file)
    return parse(storage.read_bytes(url).decode(), url).get_vocab_size()


# ------------------------------------------------------------------------- the local engine
def shard_corpora(cfgs: list[DataConfig], seq_len: int, vocab_size: int) -> list[ShardIndex]:
    """Several corpora (a mixture's components) on the local engine: each planned, the units of
    all of them on one process pool (``local_engine.py``: largest first, each worker given its
    share of the cores), each finished: their indexes in ``cfgs`` order (existing or new). The
    pool's size and cores come from the first config (components share their data section's)."""
    plans = [plan_sharding(cfg, seq_len, vocab_size) for cfg in cfgs]
    pending = list({plan.url: plan for plan in plans if isinstance(plan, ShardPlan)}.values())  # a version once
    jobs = [(plan, i) for plan in pending for i in range(len(plan.units))]
    if jobs:
        workers = cfgs[0].num_workers or machine_cores()
        for done, _ in enumerate(run_units(jobs, workers, cfgs[0].worker_cores), 1):
            if done % 50 == 0:
                log.info("sharded %d of %d units", done, len(jobs))
    finished = {plan.url: finish_sharding(plan) for plan in pending}
    return [plan if isinstance(plan, ShardIndex) else finished[plan.url] for plan in plans]


def shard_corpus(data_cfg: DataConfig, seq_len: int, vocab_size: int) -> ShardIndex:
    """Plan, shard every unit on the local engine, finish: the version's index (existing or new)."""
    return shard_corpora([data_cfg], seq_len, vocab_size)[0]


def shard_components(data_cfg: DataConfig, seq_len: int, vocab_size: int) -> list[ShardIndex]:
    """Every component of the corpus (a mixture's, or the one called "data") on the local engine,
    in ``data_cfg.components()`` order: the versions the trainer reads. A mixture's BPE is trained
    once, on all its components (``mixture_tokenizer``), so they share one vocabulary; their units
    share one process pool."""
    data = mixture_tokenizer(data_cfg, vocab_size)
    return shard_corpora(component_configs(data), seq_len, vocab_size)


def cli(argv: list[str]) -> int:
    """``megatrain shard [--config PATH] [data.shard_url=... model.seq_len=...]``"""
    from megatrain.config import load_config
    from megatrain.errors import EXIT_INPUT, one_line

    parser = argparse.ArgumentParser(prog="megatrain shard", description="tokenize a corpus into webdataset shards")
    parser.add_argument("--config", help="recipe YAML (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_source_bytes=2000000")
    args = parser.parse_args(argv)
    # A bad config or a storage outage raises: megatrain.cli says it in one line (exit 2, 75).
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        indexes = shard_components(cfg.data, cfg.seq_len, cfg.model.vocab_size)
    except DataError as exc:  # a missing, binary or refused source: one line naming it (callers of cli() too)
        print(f"megatrain shard: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_INPUT
    print("\n".join(index.summary() for index in indexes))
    return 0


def mixture_tokenizer(cfg: DataConfig, vocab_size: int) -> DataConfig:
    """A mixture's components must share one tokenizer: with ``data.tokenizer: bpe`` it is trained
    once, on the documents of every component, and stored under the shard URL by a hash of their
    inputs (``tokenizers/bpe-<hash>.json``; found there the next time). The config returned names
    that file; any other config comes back as it is."""
    if cfg.mixture is None or cfg.tokenizer != "bpe":
        return cfg
    planned = []
    for component in component_configs(cfg):
        files, _ = expand_sources(component.sources, component.max_source_bytes, component.on_bad_source)
        planned.append((component, files))
    vocab = min(cfg.bpe_vocab_size or vocab_size, vocab_size)
    key = json.dumps({"components": [[c.text_field, [dataclasses.asdict(f) for f in files]] for c, files in planned],
                      "vocab": vocab, "eos": cfg.eos_token, "on_bad_source": cfg.on_bad_source}, sort_keys=True)
    url = storage.join_url(cfg.shard_url, "tokenizers", f"bpe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")
    if not storage.exists(url):
        def documents() -> Iterator[str]:
            for component, files in planned:
                units, _ = plan_units(files, cfg.unit_bytes, _group_bytes(cfg), cfg.on_bad_source)
                for unit in units:
                    yield from read_documents(unit, component.text_field, cfg.on_bad_source, [],
                                              max_replaced_fraction=cfg.max_replaced_fraction)
        storage.write_bytes(url, train_bpe(documents(), vocab, cfg.eos_token).json_text.encode())
        log.info("trained the mixture's BPE on its %d components: %s", len(planned), url)
    return cfg.model_copy(update={"tokenizer": url})


def component_configs(cfg: DataConfig) -> list[DataConfig]:
    """One data config per mixture component (its sources and text field), or the config itself."""
    if cfg.mixture is None:
        return [cfg]
    return [cfg.model_copy(update={"mixture": None, "sources": list(c.sources), "text_field": c.text_field or cfg.text_field})
            for c in cfg.mixture]
