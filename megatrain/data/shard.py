"""Raw text -> tokenized, packed webdataset shards with an index.

The steps, in order, are the functions of this module:

1. ``collect_inputs``: expand sources (paths, globs, URLs, ``stdlib``) into a sorted file list,
   cut at ``max_source_bytes``.
2. ``fingerprint``: hash that list (names, sizes, mtimes) and the sharding parameters. The hash
   names the version directory, so re-running with the same inputs finds the finished index and
   does nothing, and different inputs write a new version beside the old one.
3. ``build_tokenizer``: train a byte-level BPE on the corpus, or load a ``tokenizer.json``.
4. ``encode_files`` on ``_Workers``: tokenize files in a process pool, results in input order.
5. ``_Packer`` + ``write_shard``: concatenate documents separated by EOS, cut windows of
   ``seq_len + 1`` tokens, write ``shard-NNNNNN.tar`` files with ``webdataset.TarWriter``.
6. ``write_index``: ``index.json`` last, so a version with an index is complete.

Every byte goes through ``megatrain.storage``, so the output (and the input) may be any URL.
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain import storage
from megatrain.config import DataConfig
from megatrain.data.index import (
    FORMAT,
    INDEX_NAME,
    TOKENIZER_NAME,
    BadShardError,
    DataError,
    ShardIndex,
    ShardInfo,
    dtype_for_vocab,
    load_index,
    write_index,
)
from megatrain.data.shard_format import write_shard

__all__ = ["BadShardError", "DataError", "ShardIndex", "ShardInfo", "cli", "load_index", "shard_corpus"]

log = logging.getLogger(__name__)
T = TypeVar("T")

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")  # what a directory source contributes
FILES_PER_TASK_BYTES = 1 << 20  # group small files into ~1 MB tokenizer tasks


@dataclass(frozen=True)
class InputFile:
    url: str
    size: int
    mtime: str  # whatever change marker the backend has (mtime, ETag); "" when none
    limit: int  # bytes to read: the whole file, or less where max_source_bytes cuts it


# ----------------------------------------------------------------------------------- 1. inputs
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


def _expand(source: str) -> dict[str, dict]:
    """One source -> {url: info}; a missing path or a glob without matches is an error."""
    if source == "stdlib":
        return _stdlib_files()
    if any(ch in source for ch in "*?["):
        found = storage.glob(source)
        if not found:
            raise DataError(f"source {source!r}: the glob matches no file")
        return found
    if not storage.exists(source):
        raise DataError(f"source {source!r}: no such file or directory")
    details = storage.info(source)
    if details.get("type") == "directory":
        found = {u: d for u, d in storage.find(source).items() if u.endswith(TEXT_SUFFIXES)}
        if not found:
            raise DataError(f"source {source!r}: the directory holds no {'/'.join(TEXT_SUFFIXES)} file")
        return found
    return {source: details}


def _change_marker(info: dict) -> str:
    for key in ("mtime", "modificationTime", "LastModified", "ETag", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def collect_inputs(sources: list[str], max_source_bytes: int | None) -> list[InputFile]:
    """Sources -> the sorted, de-duplicated files to read, cut at ``max_source_bytes``."""
    merged: dict[str, dict] = {}
    for source in sources:
        merged.update(_expand(source))
    files, budget = [], max_source_bytes
    for url in sorted(merged):
        if budget is not None and budget <= 0:
            break
        size = int(merged[url].get("size") or 0)
        limit = size if budget is None else min(size, budget)
        files.append(InputFile(url, size, _change_marker(merged[url]), limit))
        budget = None if budget is None else budget - limit
    return files


# ------------------------------------------------------------------------------ 2. fingerprint
def fingerprint(files: list[InputFile], params: dict) -> str:
    """A short hash naming the version: same inputs and parameters -> same version directory."""
    blob = json.dumps({"files": [[f.url, f.size, f.mtime, f.limit] for f in files], "params": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------- 3. documents
def read_documents(file: InputFile, text_field: str) -> list[str]:
    """The documents of one file: one per JSONL line, else the whole file."""
    with storage.open_url(file.url, "rb") as handle:
        raw = handle.read(file.limit)
    text = raw.decode("utf-8", errors="replace")  # stdlib test data holds latin-1 and broken files
    if not file.url.endswith(".jsonl"):
        return [text] if text.strip() else []
    lines = text.splitlines()
    if file.limit < file.size and lines:
        lines = lines[:-1]  # the byte budget cut the last line in the middle
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)[text_field]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(f"{file.url}:{number}: no {text_field!r} text field ({exc.__class__.__name__})") from exc
        if isinstance(doc, str) and doc:
            docs.append(doc)
    return docs


# ------------------------------------------------------------------------------- 4. tokenizer
def build_tokenizer(cfg: DataConfig, files: list[InputFile], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (at most ``vocab_size`` tokens) or load ``cfg.tokenizer``."""
    if cfg.tokenizer != "bpe":
        tokenizer = Tokenizer.from_str(storage.read_bytes(cfg.tokenizer).decode())
        if tokenizer.get_vocab_size() > vocab_size:
            size = tokenizer.get_vocab_size()
            raise DataError(f"tokenizer {cfg.tokenizer}: vocabulary {size} exceeds the model's {vocab_size}")
        if tokenizer.token_to_id(cfg.eos_token) is None:
            raise DataError(f"tokenizer {cfg.tokenizer}: has no EOS token {cfg.eos_token!r} (data.eos_token)")
        return tokenizer
    target = min(cfg.bpe_vocab_size or vocab_size, vocab_size)
    if target < 257:
        raise DataError(f"vocab size {target}: a byte-level BPE needs at least 256 bytes + EOS")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target, special_tokens=[cfg.eos_token], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, whatever the corpus
    )
    docs = (doc for file in files for doc in read_documents(file, cfg.text_field))
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer


def tokenizer_json(cfg: DataConfig, files: list[InputFile], vocab_size: int) -> str:
    return build_tokenizer(cfg, files, vocab_size).to_str()  # a string crosses process boundaries


@functools.lru_cache(maxsize=2)
def _tokenizer_from_json(text: str) -> Tokenizer:
    return Tokenizer.from_str(text)  # cached per worker process: tasks reuse one parsed tokenizer


def is_held_out(document: str, val_fraction: float) -> bool:
    """A document is validation data when a hash of its text falls in the first ``val_fraction``
    of the hash range: the same text is on the same side in every run and every file order."""
    if val_fraction <= 0:
        return False
    return int.from_bytes(hashlib.sha256(document.encode()).digest()[:8], "big") < val_fraction * 2**64


def encode_files(tokenizer_text: str, eos_id: int, text_field: str, files: list[InputFile],
                 val_fraction: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) token ids of the documents of ``files``, each document followed by
    EOS (runs in a pool worker)."""
    tokenizer = _tokenizer_from_json(tokenizer_text)
    parts: dict[bool, list[np.ndarray]] = {False: [np.empty(0, np.int64)], True: [np.empty(0, np.int64)]}
    for file in files:
        documents = read_documents(file, text_field)
        for document, encoding in zip(documents, tokenizer.encode_batch(documents)):
            parts[is_held_out(document, val_fraction)].append(np.asarray(encoding.ids + [eos_id], dtype=np.int64))
    return np.concatenate(parts[False]), np.concatenate(parts[True])


def _tasks(files: list[InputFile]) -> list[list[InputFile]]:
    """Group small files into tasks of about FILES_PER_TASK_BYTES (a task per file costs IPC)."""
    tasks, batch, size = [], [], 0
    for file in files:
        batch.append(file)
        size += file.limit
        if size >= FILES_PER_TASK_BYTES:
            tasks.append(batch)
            batch, size = [], 0
    return tasks + [batch] if batch else tasks


def _no_tokenizer_threads() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process per core already: no nested threads


class _Workers:
    """Tokenizer work in spawned processes, one per core: reading, decoding and JSON parsing are
    Python work under the GIL, so only processes spread them over cores. Spawned, not forked:
    forking a process whose tokenizer threads already ran can deadlock them. The work runs here,
    inline, when it is one task (starting a process costs about a second, more than the task) or
    when inputs are ``memory://`` files, which live inside this process only.

    If the pool breaks (a worker killed, or a caller whose main module spawn cannot re-import,
    such as ``python - < script``), the remaining work runs inline after a warning: the output
    is the same either way.
    """

    def __init__(self, processes: int, inline: bool) -> None:
        self.processes = max(1, processes)
        context = multiprocessing.get_context("spawn")
        self.pool = None if inline else ProcessPoolExecutor(
            self.processes, mp_context=context, initializer=_no_tokenizer_threads)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_pool()

    def _stop_pool(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None

    def _broken(self, exc: BaseException) -> None:
        log.warning("tokenizer process pool failed (%s); continuing in this process", exc)
        self._stop_pool()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.pool is not None:
            try:
                return self.pool.submit(fn, *args).result()
            except BrokenProcessPool as exc:
                self._broken(exc)
        return fn(*args)

    def ordered(self, fn: Callable[..., T], tasks: list[Any]) -> Iterator[T]:
        """``fn(task)`` for each task, results in task order, at most 2 per process in flight."""
        done = 0
        if self.pool is not None:
            pending: collections.deque[Future] = collections.deque()
            try:
                for task in tasks:
                    pending.append(self.pool.submit(fn, task))
                    if len(pending) >= 2 * self.processes:
                        yield pending.popleft().result()
                        done += 1
                while pending:
                    yield pending.popleft().result()
                    done += 1
                return
            except BrokenProcessPool as exc:
                self._broken(exc)
        yield from map(fn, tasks[done:])


# ------------------------------------------------------------------------------ 5. pack + write
class _Packer:
    """Concatenate token arrays and cut them into windows of ``window`` tokens (tail dropped)."""

    def __init__(self, window: int) -> None:
        self.window, self.rest = window, np.empty(0, np.int64)

    def add(self, tokens: np.ndarray) -> np.ndarray:
        joined = np.concatenate([self.rest, tokens])
        n = len(joined) // self.window
        self.rest = joined[n * self.window:]
        return joined[: n * self.window].reshape(n, self.window)


def _pack_and_write(token_arrays: Iterator[np.ndarray], url: str, seq_len: int, per_shard: int, dtype: str,
                    prefix: str = "shard") -> list[ShardInfo]:
    """Cut windows from the token stream and write full shards as they fill (the last may be short).

    Threads write while processes tokenize: storage writes are I/O and hashing frees the GIL.
    """
    packer, buffered, futures = _Packer(seq_len + 1), [], []
    written = 0  # samples handed to writers so far = the global key of the next shard's first sample
    with ThreadPoolExecutor(4) as writers:
        def flush(windows: np.ndarray) -> None:
            nonlocal written
            shard = storage.join_url(url, f"{prefix}-{len(futures):06d}.tar")
            futures.append(writers.submit(write_shard, shard, windows.astype(dtype), written))
            written += len(windows)

        for tokens in token_arrays:
            buffered.append(packer.add(tokens))
            if sum(len(b) for b in buffered) >= per_shard:
                joined = np.concatenate(buffered)
                while len(joined) >= per_shard:
                    flush(joined[:per_shard])
                    joined = joined[per_shard:]
                buffered = [joined]
        tail = np.concatenate(buffered) if buffered else np.empty((0, seq_len + 1))
        if len(tail):
            flush(tail)
        return [future.result() for future in futures]


# ------------------------------------------------------------------------------------ the API
def shard_corpus(data_cfg: DataConfig, seq_len: int, vocab_size: int) -> ShardIndex:
    """Tokenize and pack the configured corpus into shards; return the (possibly existing) index."""
    files = collect_inputs(data_cfg.sources, data_cfg.max_source_bytes)
    if not files or sum(f.limit for f in files) == 0:
        raise DataError(f"sources {data_cfg.sources}: the corpus is empty")
    tokenizer_hash = "" if data_cfg.tokenizer == "bpe" else hashlib.sha256(storage.read_bytes(data_cfg.tokenizer)).hexdigest()
    # Only what changes the output: a model that grows its padded vocab keeps the same shards.
    bpe_vocab = min(data_cfg.bpe_vocab_size or vocab_size, vocab_size) if data_cfg.tokenizer == "bpe" else None
    params = {
        "format": FORMAT, "seq_len": seq_len, "samples_per_shard": data_cfg.samples_per_shard,
        "tokenizer": data_cfg.tokenizer, "tokenizer_sha256": tokenizer_hash, "bpe_vocab_size": bpe_vocab,
        "eos_token": data_cfg.eos_token, "text_field": data_cfg.text_field, "max_source_bytes": data_cfg.max_source_bytes,
    }
    if data_cfg.val_fraction:  # only then: versions without a validation split keep their names
        params["val_fraction"] = data_cfg.val_fraction
    version = fingerprint(files, params)
    url = storage.join_url(data_cfg.shard_url, version)
    if storage.exists(storage.join_url(url, INDEX_NAME)):
        log.info("shards %s already exist: nothing to do", url)
        index = load_index(url)
        if index.vocab_size > vocab_size:
            raise DataError(f"{url}: tokenizer vocabulary {index.vocab_size} exceeds the model's {vocab_size}")
        return index

    log.info("sharding %d files (%d bytes) into %s", len(files), sum(f.limit for f in files), url)
    tasks = _tasks(files)
    inline = len(tasks) == 1 or any(f.url.startswith("memory:") for f in files)
    with _Workers(min(data_cfg.num_workers or os.cpu_count() or 1, len(tasks)), inline) as workers:
        tokenizer = Tokenizer.from_str(workers.run(tokenizer_json, data_cfg, files, vocab_size))
        eos_id = tokenizer.token_to_id(data_cfg.eos_token)
        tokenizer_bytes = tokenizer.to_str().encode()
        storage.write_bytes(storage.join_url(url, TOKENIZER_NAME), tokenizer_bytes)
        dtype = dtype_for_vocab(tokenizer.get_vocab_size())
        encode = functools.partial(encode_files, tokenizer.to_str(), eos_id, data_cfg.text_field,
                                   val_fraction=data_cfg.val_fraction)
        held_out: list[np.ndarray] = []

        def training_tokens() -> Iterator[np.ndarray]:
            for train, val in workers.ordered(encode, tasks):
                held_out.append(val)
                yield train

        shards = _pack_and_write(training_tokens(), url, seq_len, data_cfg.samples_per_shard, dtype)
        val_shards = _pack_and_write(iter(held_out), url, seq_len, data_cfg.samples_per_shard, dtype, prefix="val-shard")
    if not shards:
        raise DataError(f"sources {data_cfg.sources}: the corpus has fewer than {seq_len + 1} tokens, not one sample")

    num_samples = sum(s.num_samples for s in shards)
    index = ShardIndex(
        url=url, version=version, seq_len=seq_len, vocab_size=tokenizer.get_vocab_size(), eos_id=eos_id,
        dtype=dtype, num_samples=num_samples, num_tokens=num_samples * (seq_len + 1), shards=shards,
        tokenizer_file=TOKENIZER_NAME, tokenizer_sha256=hashlib.sha256(tokenizer_bytes).hexdigest(),
        inputs={"files": [[f.url, f.size, f.mtime, f.limit] for f in files], "bytes": sum(f.limit for f in files)},
        params=params, val_shards=val_shards,
    )
    write_index(index)
    log.info("wrote %d samples in %d shards (+ %d held-out samples) to %s", num_samples, len(shards),
             index.val_num_samples, url)
    return index


def cli(argv: list[str]) -> int:
    """``megatrain shard [--config PATH] [data.shard_url=... model.seq_len=...]``"""
    from megatrain.config import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="megatrain shard", description="tokenize a corpus into webdataset shards")
    parser.add_argument("--config", help="recipe YAML (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_source_bytes=2000000")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        index = shard_corpus(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    except (ConfigError, DataError, storage.StorageError) as exc:
        print(f"megatrain shard: {exc}", file=sys.stderr)
        return 1
    print(index.summary())
    return 0
