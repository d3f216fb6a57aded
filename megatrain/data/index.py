"""The shard index: the one file that says what a shard version holds.

``index.json`` is written last, after every shard and the tokenizer, so its presence means the
version is complete. Readers trust nothing else: shard names, sample counts, byte sizes and
sha256 digests all come from here, and the loader checks shards against them.

Formats: the index records the ``format`` its shards were written in (see shard_format.py).
Format 2 (written today) packs many samples per tar member; format 1 (one member per sample)
is still read, so versions written before format 2 stay usable without re-sharding. Fields added
since format 1 (``format``, ``bad_sources``, ``bos_id``, ``val_documents``, ``val_note``,
``replaced_bytes``) have defaults, so an old index.json, and code that builds a ShardIndex with
keyword arguments, keep working.
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
FORMAT = 2  # what new versions are written in; bump when the layout of shards or of this file changes
READABLE_FORMATS = (1, 2)  # what load_index accepts: shard_format.decode_shard reads both layouts
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
    # Sources the sharder skipped as unreadable, each {"url": ..., "reason": ...}: a version built
    # without them must say so, or a reader would believe it holds the whole configured corpus.
    bad_sources: list[dict[str, Any]] = field(default_factory=list)
    bos_id: int | None = None  # the tokenizer's beginning-of-sequence id, if it has (and uses) one
    # The shard layout (shard_format.py). New fields go last: positional construction keeps working.
    format: int = FORMAT
    # The validation split (held_out.py): its documents (None: a version sharded before it was
    # counted) and, in one line, why there is none, or how the floor made one; "" when rule 1 sufficed
    val_documents: int | None = None
    val_note: str = ""
    # Text decoding (decoding.py): per input file, its bytes that were not UTF-8 and became U+FFFD
    # (files without any are left out; empty for versions sharded before it was counted)
    replaced_bytes: dict[str, int] = field(default_factory=dict)

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
        # "format" is the field's: an old index rewritten (a shard repaired, say) stays format 1.
        # decode_shard tells the layouts apart per member, so a format-2 shard inside it still reads.
        return out

    def summary(self) -> str:
        total = sum(s.bytes for s in self.shards)
        return (
            f"shard version {self.version} (format {self.format}) at {self.url}\n"
            f"  {self.num_samples} samples of {self.seq_len}+1 tokens ({self.num_tokens} tokens), "
            f"{len(self.shards)} shards, {total / 1e6:.1f} MB\n"
            f"  tokenizer {self.tokenizer_file}: vocab {self.vocab_size}, eos id {self.eos_id}, dtype {self.dtype}\n"
            f"  inputs: {len(self.inputs.get('files', []))} files, {self.inputs.get('bytes', 0)} bytes read"
            + (f"\n  {describe_replaced(self.replaced_bytes)}" if self.replaced_bytes else "")
        )


def describe_replaced(replaced: dict[str, int]) -> str:
    """``text decoding: 312 bytes that are not UTF-8 became U+FFFD in 2 files (most: a.txt 300)``."""
    worst = max(replaced, key=lambda url: (replaced[url], url))
    files = len(replaced)
    return (f"text decoding: {sum(replaced.values()):,} bytes that are not UTF-8 became U+FFFD in {files} "
            f"file{'' if files == 1 else 's'} (most: {worst.rsplit('/', 1)[-1]} {replaced[worst]:,})")


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 halves shard size and I/O whenever every token id fits (ids < 65536)."""
    return "uint16" if vocab_size <= 65536 else "int32"


def index_from_json(url: str, raw: dict[str, Any]) -> ShardIndex:
    """Build a ShardIndex from parsed index.json contents found at version directory ``url``."""
    try:
        version = raw.get("format")
        if type(version) is not int or version not in READABLE_FORMATS:  # not True, which == 1
            raise DataError(f"{url}: index format {version!r}, this code reads format {FORMAT} "
                            f"(and the older {', '.join(map(str, READABLE_FORMATS[:-1]))})")
        fields = dict(raw)  # format, bad_sources and bos_id are absent from older indexes: defaults
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
