"""The name a shard version had before shard format 2, so a campaign sharded then resumes on it.

A checkpoint's data position names its shard version, and a loader refuses a position of another
version. Format 1 versions (one sample per tar member, one token stream over all files) were
named by a hash of the plain text and JSONL files read and of the parameters below; a run whose
corpus that code could read computes that name first, and if the version is there, complete,
it trains on it (format 1 shards still read) instead of sharding anew under a new name.
"""

from __future__ import annotations

import hashlib
import json

from megatrain import storage
from megatrain.config import DataConfig
from megatrain.data.sources import SourceFile

_OLD_DIRECTORY_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")  # what a folder contributed then


def _old_files(cfg: DataConfig, files: list[SourceFile]) -> list[list] | None:
    """The input description format 1 hashed, or None when that code could not read this corpus."""
    if any(f.kind not in ("text", "jsonl") or f.compression for f in files):
        return None
    folders = [s for s in cfg.sources if s != "stdlib" and not any(c in s for c in "*?[")
               and storage.exists(s) and storage.info(s).get("type") == "directory"]
    described = []
    for f in files:
        inside_folder = any(f.url.startswith(folder.rstrip("/") + "/") for folder in folders)
        if inside_folder and not f.url.endswith(_OLD_DIRECTORY_SUFFIXES):
            return None  # a file format 1 did not take from a folder: that version cannot exist
        described.append([f.url, f.size, f.mtime, f.limit])
    return described


def legacy_version(cfg: DataConfig, files: list[SourceFile], seq_len: int, vocab_size: int) -> str | None:
    """The format 1 version name of this corpus and parameters, or None."""
    described = _old_files(cfg, files)
    if described is None or cfg.on_bad_source != "error" or cfg.unit_bytes != DataConfig().unit_bytes:
        return None
    tokenizer_sha = ""
    if cfg.tokenizer != "bpe":
        if not storage.exists(cfg.tokenizer) or storage.info(cfg.tokenizer).get("type") == "directory":
            return None  # a model folder was not a tokenizer then
        tokenizer_sha = hashlib.sha256(storage.read_bytes(cfg.tokenizer)).hexdigest()
    params = {
        "format": 1, "seq_len": seq_len, "samples_per_shard": cfg.samples_per_shard, "tokenizer": cfg.tokenizer,
        "tokenizer_sha256": tokenizer_sha,
        "bpe_vocab_size": min(cfg.bpe_vocab_size or vocab_size, vocab_size) if cfg.tokenizer == "bpe" else None,
        "eos_token": cfg.eos_token, "text_field": cfg.text_field, "max_source_bytes": cfg.max_source_bytes,
    }
    if cfg.val_fraction:
        params["val_fraction"] = cfg.val_fraction
    blob = json.dumps({"files": described, "params": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
