"""The bytes of one shard: a tar of packed token windows, written and read back.

``write_shard`` writes a tar (webdataset's layout) with member ``<9-digit global sample
index>.tokens.npy`` per window; ``decode_shard`` reads one back into [samples, seq_len + 1] tokens,
naming the shard in a ``BadShardError`` for any damage; ``check_token_ids`` holds every id inside
the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np

from megatrain import storage
from megatrain.data.index import SAMPLE_FIELD, BadShardError, ShardInfo


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through to the real file."""

    def __init__(self, inner: io.RawIOBase) -> None:
        self.inner, self.sha, self.count = inner, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.count += len(data)
        self.inner.write(data)
        return len(data)


def _npy(window: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, window, allow_pickle=False)
    return buffer.getvalue()


def write_shard(url: str, windows: np.ndarray, first_key: int) -> ShardInfo:
    """Write one tar shard: member ``<9-digit global sample index>.tokens.npy`` per window."""
    import webdataset  # here, not at the top: it imports torch, which tokenizer workers never need

    with storage.open_url(url, "wb") as handle:
        stream = _HashingWriter(handle)
        # mtime=0 and fixed owners: the same windows always give byte-identical shards.
        with webdataset.TarWriter(stream, mtime=0, user="megatrain", group="megatrain", encoder=False) as tar:
            for i, window in enumerate(windows):
                tar.write({"__key__": f"{first_key + i:09d}", SAMPLE_FIELD: _npy(window)})
    return ShardInfo(url.rsplit("/", 1)[-1], len(windows), stream.sha.hexdigest(), stream.count)


def decode_shard(url: str, data: bytes, expected: int, seq_len: int, dtype: np.dtype) -> np.ndarray:
    """Tar bytes -> [samples, seq_len + 1] tokens; any damage raises BadShardError naming ``url``."""
    samples = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.name.endswith("." + SAMPLE_FIELD):
                    payload = tar.extractfile(member).read()
                    if len(payload) != member.size:
                        raise BadShardError(url, f"member {member.name} is truncated")
                    samples.append(np.load(io.BytesIO(payload), allow_pickle=False))
        array = np.stack(samples) if samples else np.empty((0, seq_len + 1), dtype)
    except BadShardError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise BadShardError(url, f"cannot be read as a tar of .npy samples ({exc.__class__.__name__}: {exc})") from exc
    if len(samples) != expected:
        raise BadShardError(url, f"holds {len(samples)} samples, the index says {expected} (truncated?)")
    if array.shape[1:] != (seq_len + 1,) or array.dtype != dtype:
        raise BadShardError(url, f"samples are {array.dtype}{list(array.shape[1:])}, expected {dtype}[{seq_len + 1}]")
    return array


def check_token_ids(url: str, samples: np.ndarray, vocab_size: int) -> None:
    """Raise BadShardError unless every id in ``samples`` [n, seq_len + 1] is in [0, vocab_size)."""
    if samples.size == 0 or (int(samples.min()) >= 0 and int(samples.max()) < vocab_size):
        return
    bad_rows = np.flatnonzero(((samples < 0) | (samples >= vocab_size)).any(axis=1))
    row = samples[bad_rows[0]]
    bad_id = int(row[(row < 0) | (row >= vocab_size)][0])
    raise BadShardError(url, f"sample {int(bad_rows[0])} holds token id {bad_id}, outside the model's vocabulary "
                             f"of {vocab_size} ({len(bad_rows)} bad sample{'s' * (len(bad_rows) != 1)} in this shard)")
