"""Shard format 2 (many samples per tar member): its size, round trip, determinism, damage and
readers; format-1 shards and indexes (one member per sample) still read, by decode and loader."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset

from megatrain.data.index import (
    FORMAT, INDEX_NAME, BadShardError, DataError, ShardIndex, ShardInfo, index_from_json, load_index, write_index,
)
from megatrain.data.loader import build_loader
from megatrain.data.shard_format import decode_shard, samples_per_member, write_shard

SAMPLES_PER_SHARD = 1024  # DataConfig's samples_per_shard in real recipes


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_format1_shard(url: str, windows: np.ndarray, first_key: int) -> ShardInfo:
    """The layout before format 2, as the old write_shard wrote it: one 1-D member per sample."""
    buffer = io.BytesIO()
    with webdataset.TarWriter(buffer, mtime=0, user="megatrain", group="megatrain", encoder=False) as tar:
        for i, window in enumerate(windows):
            tar.write({"__key__": f"{first_key + i:09d}", "tokens.npy": npy(window)})
    data = buffer.getvalue()
    Path(url).write_bytes(data)
    return ShardInfo(Path(url).name, len(windows), hashlib.sha256(data).hexdigest(), len(data))


def windows_of(samples: int, seq_len: int, dtype: str = "uint16", seed: int = 0) -> np.ndarray:
    high = 60_000 if dtype == "uint16" else 2**31 - 1
    return np.random.default_rng(seed).integers(0, high, (samples, seq_len + 1)).astype(dtype)


def write_version(writer, root: Path, windows: np.ndarray) -> list[ShardInfo]:
    """``windows`` cut into shards of SAMPLES_PER_SHARD (the last one short), as the sharder does."""
    root.mkdir(parents=True, exist_ok=True)
    return [writer(str(root / f"shard-{i // SAMPLES_PER_SHARD:06d}.tar"), windows[i:i + SAMPLES_PER_SHARD], i)
            for i in range(0, len(windows), SAMPLES_PER_SHARD)]


def tar_names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return tar.getnames()


# ------------------------------------------------------------------------------------ size
@pytest.mark.parametrize("seq_len", [16, 64, 128, 512, 2048, 8192])
def test_a_version_is_at_most_1_1x_its_token_bytes(tmp_path, seq_len):
    """Three full shards plus a short last one, uint16 (the worst case: the fewest token bytes per
    header). Counted: every byte on disk, end-of-archive blocks and record padding included."""
    windows = windows_of(3 * SAMPLES_PER_SHARD + 37, seq_len)
    ratios = {}
    for name, writer in (("format 1", write_format1_shard), ("format 2", write_shard)):
        shards = write_version(writer, tmp_path / name, windows)
        on_disk = sum(p.stat().st_size for p in (tmp_path / name).iterdir())
        assert on_disk == sum(s.bytes for s in shards)
        ratios[name] = on_disk / windows.nbytes
    print(f"seq_len {seq_len}: disk / token bytes = {ratios['format 1']:.3f} (format 1), "
          f"{ratios['format 2']:.4f} (format 2)")
    assert ratios["format 2"] <= 1.1


# ------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("dtype", ["uint16", "int32"])
@pytest.mark.parametrize(("samples", "seq_len"), [(1, 16), (1, 8191), (500, 64), (70, 8191)])
def test_decode_gives_back_what_was_written(tmp_path, dtype, samples, seq_len):
    windows = windows_of(samples, seq_len, dtype)
    url = str(tmp_path / "shard-000000.tar")
    info = write_shard(url, windows, first_key=4000)
    data = Path(url).read_bytes()
    assert info == ShardInfo("shard-000000.tar", samples, hashlib.sha256(data).hexdigest(), len(data))
    decoded = decode_shard(url, data, samples, seq_len, np.dtype(dtype))
    assert decoded.dtype == np.dtype(dtype) and np.array_equal(decoded, windows)
    # one 2-D member per k consecutive samples, named by the key of its first sample
    k = samples_per_member(seq_len, np.dtype(dtype))
    assert tar_names(data) == [f"{4000 + start:09d}.tokens.npy" for start in range(0, samples, k)]


def test_members_hold_about_a_mebibyte_and_at_least_one_sample():
    assert samples_per_member(16, np.dtype("uint16")) == (1 << 20) // 34
    assert samples_per_member(8191, np.dtype("int32")) == 32
    assert samples_per_member(1 << 20, np.dtype("int32")) == 1


def test_the_same_windows_give_byte_identical_shards(tmp_path):
    windows = windows_of(300, 128)
    first = write_shard(str(tmp_path / "a.tar"), windows, first_key=7)
    second = write_shard(str(tmp_path / "b.tar"), windows.copy(), first_key=7)
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert (first.sha256, first.bytes) == (second.sha256, second.bytes)


def test_a_format2_shard_is_a_tar_that_tarfile_and_webdataset_read(tmp_path):
    windows = windows_of(70, 8191, "int32")  # k = 32: members of 32, 32 and 6 samples
    url = str(tmp_path / "shard-000000.tar")
    write_shard(url, windows, first_key=100)
    data = Path(url).read_bytes()
    assert len(data) % tarfile.BLOCKSIZE == 0 and data[-2 * tarfile.BLOCKSIZE:] == bytes(2 * tarfile.BLOCKSIZE)
    with tarfile.open(url) as tar:
        members = tar.getmembers()
        assert [(m.name, m.uname, m.mtime) for m in members] == [
            (f"{key:09d}.tokens.npy", "megatrain", 0) for key in (100, 132, 164)]
        arrays = [np.load(io.BytesIO(tar.extractfile(m).read())) for m in members]
    assert [a.shape for a in arrays] == [(32, 8192), (32, 8192), (6, 8192)]
    samples = list(webdataset.WebDataset(url, shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["000000100", "000000132", "000000164"]
    assert np.array_equal(np.concatenate([np.load(io.BytesIO(s["tokens.npy"])) for s in samples]), windows)


# ------------------------------------------------------------------------------------ format 1
@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_format1_shard_still_decodes(tmp_path, dtype):
    windows = windows_of(40, 32, dtype)
    url = str(tmp_path / "old.tar")
    info = write_format1_shard(url, windows, 0)
    data = Path(url).read_bytes()
    assert len(tar_names(data)) == 40 and info.bytes == len(data)
    assert np.array_equal(decode_shard(url, data, 40, 32, np.dtype(dtype)), windows)


def format1_index_json(shards: list[ShardInfo], seq_len: int, dtype: str) -> dict:
    """index.json exactly as format-1 code wrote it: no bad_sources, bos_id."""
    num_samples = sum(s.num_samples for s in shards)
    return {"format": 1, "version": "old", "seq_len": seq_len, "vocab_size": 60_000, "eos_id": 0, "dtype": dtype,
            "num_samples": num_samples, "num_tokens": num_samples * (seq_len + 1), "tokenizer_file": "tokenizer.json",
            "tokenizer_sha256": "0" * 64, "inputs": {}, "params": {"format": 1}, "val_shards": [],
            "shards": [{"name": s.name, "num_samples": s.num_samples, "sha256": s.sha256, "bytes": s.bytes}
                       for s in shards]}


def test_a_format1_version_loads_and_the_loader_reads_it(tmp_path):
    version, seq_len = tmp_path / "old", 32
    windows = windows_of(96, seq_len)
    version.mkdir()
    shards = [write_format1_shard(str(version / f"shard-{i:06d}.tar"), windows[i * 32:(i + 1) * 32], i * 32)
              for i in range(3)]
    (version / INDEX_NAME).write_text(json.dumps(format1_index_json(shards, seq_len, "uint16")))
    index = load_index(str(version))
    assert (index.format, index.bad_sources, index.bos_id, index.shards) == (1, [], None, shards)
    assert index.to_json()["format"] == 1  # rewriting an old index keeps saying what its shards are
    loader = build_loader(index, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2,
                          shuffle_shards=0)
    served = []
    for _ in range(96 // 4):
        inputs, targets = next(loader)
        served.append(np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1))
    loader.close()
    assert sorted(map(bytes, np.concatenate(served).astype("uint16"))) == sorted(map(bytes, windows))


# ------------------------------------------------------------------------------------ damage
@pytest.fixture
def shard(tmp_path) -> tuple[str, bytes, np.ndarray]:
    windows = windows_of(70, 8191, "int32")  # three members
    url = str(tmp_path / "shard-000000.tar")
    write_shard(url, windows, 0)
    return url, Path(url).read_bytes(), windows


def raises_naming(url: str, reason: str):
    return pytest.raises(BadShardError, match=rf"^bad shard {re.escape(url)}: .*({reason})")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])
def test_a_truncated_shard_is_a_bad_shard(shard, keep):
    url, data, windows = shard
    with raises_naming(url, "truncated|cannot be read as a tar|holds"):
        decode_shard(url, data[: int(len(data) * keep)], len(windows), 8191, np.dtype("int32"))


@pytest.mark.parametrize("member", [np.zeros((3, 10), "int32"), np.zeros((2, 3, 8192), "int32"),
                                    np.zeros((3, 8192), "uint16"), np.zeros(10, "int32")],
                         ids=["wrong-width", "3-d", "wrong-dtype", "1-d-wrong-width"])
def test_a_member_of_the_wrong_shape_or_dtype_is_a_bad_shard(tmp_path, member):
    url, buffer = str(tmp_path / "odd.tar"), io.BytesIO()
    with webdataset.TarWriter(buffer, mtime=0, encoder=False) as tar:
        tar.write({"__key__": f"{0:09d}", "tokens.npy": npy(np.zeros((2, 8192), "int32"))})
        tar.write({"__key__": f"{2:09d}", "tokens.npy": npy(member)})
    with raises_naming(url, r"member 000000002.tokens.npy holds .*, expected int32\[8192\] or int32\[k, 8192\]"):
        decode_shard(url, buffer.getvalue(), 5, 8191, np.dtype("int32"))


@pytest.mark.parametrize("expected", [69, 71, 0])
def test_a_sample_count_unlike_the_index_is_a_bad_shard(shard, expected):
    url, data, _ = shard
    with raises_naming(url, "holds 70 samples, the index says"):
        decode_shard(url, data, expected, 8191, np.dtype("int32"))


def test_garbage_is_a_bad_shard(shard):
    url, data, windows = shard
    with raises_naming(url, "cannot be read as a tar"):
        decode_shard(url, bytes(range(256)) * 8 + data, len(windows), 8191, np.dtype("int32"))


# ------------------------------------------------------------------------------------ the index
def new_index(url: str, **extra) -> ShardIndex:
    return ShardIndex(url=url, version="v", seq_len=4, vocab_size=16, eos_id=0, dtype="uint16", num_samples=2,
                      num_tokens=10, shards=[ShardInfo("shard-000000.tar", 2, "0" * 64, 1024)],
                      tokenizer_file="tokenizer.json", tokenizer_sha256="0" * 64, **extra)


def test_an_index_built_by_keyword_is_format_2_and_round_trips_its_new_fields(tmp_path):
    plain = new_index(str(tmp_path))
    assert (FORMAT, plain.format, plain.bad_sources, plain.bos_id) == (2, 2, [], None)
    full = new_index(str(tmp_path), bos_id=1, bad_sources=[{"url": "s3://b/x.jsonl", "reason": "not UTF-8"}])
    write_index(full)
    raw = json.loads((tmp_path / INDEX_NAME).read_text())
    assert raw["format"] == 2 and raw["bos_id"] == 1 and raw["bad_sources"][0]["reason"] == "not UTF-8"
    assert load_index(str(tmp_path)) == full


@pytest.mark.parametrize("version", [0, 3, None, "2", True])
def test_an_index_of_another_format_is_refused(tmp_path, version):
    raw = new_index(str(tmp_path)).to_json()
    raw["format"] = version
    if version is None:
        del raw["format"]
    with pytest.raises(DataError, match=rf"index format {re.escape(repr(version))}, this code reads format 2"):
        index_from_json(str(tmp_path), raw)
