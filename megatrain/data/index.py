"""The shard index: the one file that says what a shard version holds.

``index.json`` is written last, after every shard and the tokenizer, so its presence means the
version is complete. Readers trust nothing else: shard names, sample counts, byte sizes and
sha256 digests all come from here, and the loader checks shards against them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from megatrain import storage
from megatrain.errors import InputError

INDEX_NAME = "index.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = 1  # bump when the layout of shards or of this file changes
SAMPLE_FIELD = "tokens.npy"  # the tar member suffix of one packed window


class DataError(ValueError):
    """Input data that cannot be used: the message names the file, shard or URL."""


class BadShardError(DataError, InputError):
    """A shard that is missing, truncated, corrupt, does not match its checksum, or holds token ids
    outside the vocabulary. Deterministic (under ``on_bad_shard: error`` the stage ends at once):
    the next attempt would read the same bytes. A storage outage is not this, but a StorageError."""

    def __init__(self, url: str, reason: str, rank: int | None = None) -> None:
        super().__init__(f"bad shard {url}: {reason}" + (f" (read by rank {rank})" if rank is not None else ""))
        self.url, self.reason, self.rank = url, reason, rank


@dataclass(frozen=True)
class ShardInfo:
    name: str  # file name inside the version directory
    num_samples: int
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ShardIndex:
    """A complete shard version. ``url`` is the version directory."""

    url: str
    version: str
    seq_len: int  # each sample holds seq_len + 1 tokens: inputs and the targets shifted by one
    vocab_size: int  # the tokenizer's real size (<= the model's embedding rows)
    eos_id: int
    dtype: str  # numpy dtype name of stored tokens: uint16 or int32
    num_samples: int
    num_tokens: int  # tokens in the packed windows (num_samples * (seq_len + 1))
    shards: list[ShardInfo]
    tokenizer_file: str
    tokenizer_sha256: str
    inputs: dict[str, Any] = field(default_factory=dict)  # the fingerprinted input description
    params: dict[str, Any] = field(default_factory=dict)  # the sharding parameters
    # held-out documents (data.val_fraction), packed into their own shards: never in ``shards``
    val_shards: list[ShardInfo] = field(default_factory=list)

    @property
    def val_num_samples(self) -> int:
        return sum(s.num_samples for s in self.val_shards)

    @property
    def index_url(self) -> str:
        return storage.join_url(self.url, INDEX_NAME)

    def shard_url(self, i: int) -> str:
        """Shard ``i``'s URL; its name comes from index.json, so it must stay in the version dir."""
        return storage.confined(self.url, self.shards[i].name, self.index_url)

    @property
    def tokenizer_url(self) -> str:
        return storage.confined(self.url, self.tokenizer_file, self.index_url)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("url")  # the index may be copied elsewhere; where it lies is not part of it
        out["format"] = FORMAT
        return out

    def summary(self) -> str:
        total = sum(s.bytes for s in self.shards)
        return (
            f"shard version {self.version} at {self.url}\n"
            f"  {self.num_samples} samples of {self.seq_len}+1 tokens ({self.num_tokens} tokens), "
            f"{len(self.shards)} shards, {total / 1e6:.1f} MB\n"
            f"  tokenizer {self.tokenizer_file}: vocab {self.vocab_size}, eos id {self.eos_id}, dtype {self.dtype}\n"
            f"  inputs: {len(self.inputs.get('files', []))} files, {self.inputs.get('bytes', 0)} bytes read"
        )


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 halves shard size and I/O whenever every token id fits (ids < 65536)."""
    return "uint16" if vocab_size <= 65536 else "int32"


def index_from_json(url: str, raw: dict[str, Any]) -> ShardIndex:
    """Build a ShardIndex from parsed index.json contents found at version directory ``url``."""
    try:
        if raw.get("format") != FORMAT:
            raise DataError(f"{url}: index format {raw.get('format')!r}, this code reads format {FORMAT}")
        fields = {k: v for k, v in raw.items() if k != "format"}
        fields["shards"] = [ShardInfo(**s) for s in raw["shards"]]
        fields["val_shards"] = [ShardInfo(**s) for s in raw.get("val_shards", [])]
        index = ShardIndex(url=url, **fields)
    except (KeyError, TypeError) as exc:
        raise DataError(f"{storage.join_url(url, INDEX_NAME)}: malformed index ({exc})") from exc
    # Every name from the index must stay in the version dir: refuse a hostile index at load.
    for name in [index.tokenizer_file, *(s.name for s in index.shards)]:
        storage.confined(url, name, index.index_url)
    if sum(s.num_samples for s in index.shards) != index.num_samples:
        raise DataError(f"{storage.join_url(url, INDEX_NAME)}: shard sample counts do not add up to num_samples")
    return index


def load_index(url: str) -> ShardIndex:
    """Read the index of a shard version: ``url`` is the version directory or its index.json."""
    url = url.rstrip("/")
    if url.endswith("/" + INDEX_NAME) or url == INDEX_NAME:
        url = storage.parent_url(url)
    index_url = storage.join_url(url, INDEX_NAME)
    if not storage.exists(index_url):
        raise DataError(f"{index_url}: no shard index here (sharding never finished, or a wrong URL)")
    try:
        raw = json.loads(storage.read_bytes(index_url))
    except json.JSONDecodeError as exc:
        raise DataError(f"{index_url}: not valid JSON ({exc})") from exc
    return index_from_json(url, raw)


def write_index(index: ShardIndex) -> None:
    """Publish the index atomically; call it only when every shard is written."""
    data = json.dumps(index.to_json(), indent=1, sort_keys=True).encode()
    storage.write_bytes(storage.join_url(index.url, INDEX_NAME), data)
