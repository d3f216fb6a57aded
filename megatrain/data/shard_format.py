"""The bytes of one shard: a tar of packed token windows, written and read back.

A shard is a webdataset-style tar (plain POSIX ustar, readable by ``tarfile``, ``tar`` and
``webdataset``) of members ``<9-digit key>.tokens.npy``; the key is a global sample index.

* Format 2 (what ``write_shard`` writes): each member is a 2-D ``.npy`` array [k, seq_len + 1] of
  k consecutive samples, named by the key of its first sample. k is chosen so that a member holds
  about ``MEMBER_BYTES`` of tokens (at least one sample), and the archive ends right after its two
  end-of-archive blocks. Per member that costs a 512-byte tar header, a 128-byte npy header and
  under 512 bytes of padding, per shard 1 KiB: at seq_len 16 and 1024 samples a shard is ~1.06x
  its token bytes, at any longer seq_len less.
* Format 1 (written before; still read): one member per sample, a 1-D array [seq_len + 1]. At
  seq_len 128 that is ~4x the token bytes (each 258-byte sample pays a 512-byte header, a 128-byte
  npy header and padding to 512), which is why format 2 exists.

``decode_shard`` reads either layout member by member (a 1-D member is one sample, a 2-D member
k samples) into [samples, seq_len + 1] tokens, naming the shard in a ``BadShardError`` for any
damage; ``check_token_ids`` holds every id inside the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np

from megatrain import storage
from megatrain.data.index import SAMPLE_FIELD, BadShardError, ShardInfo

# Tokens per member: large enough that headers and padding vanish next to the payload, small
# enough that a member is one modest allocation while writing and decoding.
MEMBER_BYTES = 1 << 20


class _HashingWriter:
    """A write-only stream that hashes and counts what passes through to the real file.

    ``end``, once set, is where the archive ends: bytes past it are dropped. tarfile pads every
    archive it closes to a 10 KiB record (``tarfile.RECORDSIZE``, a tape-era blocking factor that
    neither its ``bufsize`` nor webdataset lets one change); no reader needs that padding, and for
    a small shard it is most of the file. Everything past ``end`` is that padding, all zeros.
    """

    def __init__(self, inner: io.RawIOBase) -> None:
        self.inner, self.sha, self.count = inner, hashlib.sha256(), 0
        self.end: int | None = None

    def write(self, data: bytes) -> int:
        size = len(data)
        if self.end is not None:
            data = data[: max(0, self.end - self.count)]
        self.sha.update(data)
        self.count += len(data)
        self.inner.write(data)
        return size  # tarfile's stream wants all of it taken: what is dropped is padding


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def samples_per_member(seq_len: int, dtype: np.dtype) -> int:
    """k of format 2: as many whole samples as fit in MEMBER_BYTES, and at least one."""
    return max(1, MEMBER_BYTES // ((seq_len + 1) * np.dtype(dtype).itemsize))


def _member(name: str, size: int) -> tarfile.TarInfo:
    """The tar header of a member, as webdataset's TarWriter writes it (ustar, read-only, owner
    megatrain) with mtime 0, so the same windows always give byte-identical shards."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "megatrain", "megatrain"
    return info


def write_shard(url: str, windows: np.ndarray, first_key: int) -> ShardInfo:
    """Write one format-2 tar shard of ``windows`` [samples, seq_len + 1]; sample i has key
    ``first_key + i``. The sha256 and byte count are those of the bytes written. Plain ``tarfile``
    (webdataset's TarWriter adds nothing here but an import of torch in every sharding worker)."""
    k = samples_per_member(windows.shape[1] - 1, windows.dtype)
    with storage.open_url(url, "wb") as handle:
        stream = _HashingWriter(handle)
        tar = tarfile.open(fileobj=stream, mode="w|", format=tarfile.USTAR_FORMAT)
        try:
            for start in range(0, len(windows), k):
                payload = _npy(windows[start:start + k])
                tar.addfile(_member(f"{first_key + start:09d}.{SAMPLE_FIELD}", len(payload)), io.BytesIO(payload))
            # The members end at tarfile's offset; the two zero blocks after them end the archive.
            stream.end = tar.offset + 2 * tarfile.BLOCKSIZE
        finally:
            tar.close()
    return ShardInfo(url.rsplit("/", 1)[-1], len(windows), stream.sha.hexdigest(), stream.count)


def _samples_of(url: str, name: str, array: np.ndarray, seq_len: int, dtype: np.dtype) -> np.ndarray:
    """One member's array as [k, seq_len + 1]: format 1 holds one sample, format 2 k of them."""
    if array.ndim not in (1, 2) or array.shape[-1] != seq_len + 1 or array.dtype != dtype:
        raise BadShardError(url, f"member {name} holds {array.dtype}{list(array.shape)}, "
                                 f"expected {dtype}[{seq_len + 1}] or {dtype}[k, {seq_len + 1}]")
    return array.reshape(-1, seq_len + 1)


def decode_shard(url: str, data: bytes, expected: int, seq_len: int, dtype: np.dtype) -> np.ndarray:
    """Tar bytes of either format -> [samples, seq_len + 1] tokens; any damage raises
    BadShardError naming ``url``: one np.load per member, then one concatenate."""
    dtype = np.dtype(dtype)
    parts = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.name.endswith("." + SAMPLE_FIELD):
                    payload = tar.extractfile(member).read()
                    if len(payload) != member.size:
                        raise BadShardError(url, f"member {member.name} is truncated")
                    array = np.load(io.BytesIO(payload), allow_pickle=False)
                    parts.append(_samples_of(url, member.name, array, seq_len, dtype))
    except BadShardError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise BadShardError(url, f"cannot be read as a tar of .npy samples ({exc.__class__.__name__}: {exc})") from exc
    count = sum(len(part) for part in parts)
    if count != expected:
        raise BadShardError(url, f"holds {count} samples, the index says {expected} (truncated?)")
    return np.concatenate(parts) if parts else np.empty((0, seq_len + 1), dtype)


def check_token_ids(url: str, samples: np.ndarray, vocab_size: int) -> None:
    """Raise BadShardError unless every id in ``samples`` [n, seq_len + 1] is in [0, vocab_size)."""
    if samples.size == 0 or (int(samples.min()) >= 0 and int(samples.max()) < vocab_size):
        return
    bad_rows = np.flatnonzero(((samples < 0) | (samples >= vocab_size)).any(axis=1))
    row = samples[bad_rows[0]]
    bad_id = int(row[(row < 0) | (row >= vocab_size)][0])
    raise BadShardError(url, f"sample {int(bad_rows[0])} holds token id {bad_id}, outside the model's "
                             f"vocabulary of {vocab_size} ({len(bad_rows)} bad sample{'s' * (len(bad_rows) != 1)} in this shard)")
