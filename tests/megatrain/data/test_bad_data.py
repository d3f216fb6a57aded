"""Bad shards: a clear error naming the shard, or with on_bad_shard=skip a counted, logged skip."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from data_helpers import all_windows

from megatrain.data.index import BadShardError
from megatrain.data.loader import build_loader
from megatrain.data.shard_format import write_shard


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0:100] = bytes(100)  # the first member's tar header (format 1 and 2 both start with one)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def replace_with_other_samples(path: Path, samples: int, width: int) -> None:
    """A well-formed shard with other content: only the checksum can tell."""
    write_shard(str(path), np.full((samples, width), 7, np.uint16), 0)


def remove(path: Path) -> None:
    path.unlink()


def epoch(loader, index) -> np.ndarray:
    steps = index.num_samples // 4
    return np.concatenate([next(loader)[0].numpy() for _ in range(steps)])


@pytest.mark.parametrize(
    ("damage", "verify", "reason"),
    [
        (corrupt, True, "sha256 does not match"),
        (corrupt, False, "cannot be read as a tar|holds|truncated"),
        (truncate, True, "bytes, the index says"),
        (truncate, False, "cannot be read as a tar|holds|truncated"),
        (replace_with_other_samples, True, "sha256 does not match"),
        (remove, True, "not found"),
    ],
)
def test_bad_shard_is_an_error_naming_it(index_copy, damage, verify, reason):
    target = Path(index_copy.shard_url(2))
    if damage is replace_with_other_samples:
        damage(target, index_copy.shards[2].num_samples, index_copy.seq_len + 1)
    else:
        damage(target)
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2,
                          verify_checksums=verify, shuffle_shards=0)
    with pytest.raises(BadShardError, match=rf"bad shard {target}: .*({reason})"):
        epoch(loader, index_copy)
    loader.close()


def test_without_checksums_a_well_formed_replacement_is_read(index_copy):
    replace_with_other_samples(Path(index_copy.shard_url(2)), index_copy.shards[2].num_samples, index_copy.seq_len + 1)
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=0,
                          verify_checksums=False)
    assert (epoch(loader, index_copy) == 7).all(axis=1).any()


@pytest.mark.parametrize("damage", [corrupt, truncate, remove])
def test_skip_mode_counts_logs_and_never_serves_bad_data(index_copy, damage, caplog):
    good = all_windows(index_copy)
    bad_set = {w.tobytes() for w in good[1][:, :-1]} - {w.tobytes() for i, s in enumerate(good) if i != 1 for w in s[:, :-1]}
    damage(Path(index_copy.shard_url(1)))
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2,
                          on_bad_shard="skip", shuffle_shards=4)
    with caplog.at_level(logging.WARNING, logger="megatrain.data.loader"):
        served = epoch(loader, index_copy)
    assert loader.bad_shards == 1 and loader.state_dict()["bad_shards"] == 1
    assert any(index_copy.shard_url(1) in record.getMessage() for record in caplog.records)
    assert len(served) == (index_copy.num_samples // 4) * 4  # batch shapes kept: substitutes fill in
    assert not {row.tobytes() for row in served} & bad_set
    loader.close()


def test_skip_mode_still_fails_when_a_whole_window_is_bad(index_copy):
    for i in range(len(index_copy.shards)):
        remove(Path(index_copy.shard_url(i)))
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=0,
                          on_bad_shard="skip", shuffle_shards=2)
    with pytest.raises(BadShardError, match="every shard of its shuffle window"):
        next(loader)
    assert loader.bad_shards == 2


def test_an_error_can_be_retried_after_the_shard_is_repaired(index_copy, small_index):
    targets = [Path(index_copy.shard_url(i)) for i in range(len(index_copy.shards))]
    originals = [t.read_bytes() for t in targets]
    for target in targets:
        remove(target)
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2, shuffle_shards=0)
    with pytest.raises(BadShardError):
        next(loader)
    for target, original in zip(targets, originals):
        target.write_bytes(original)
    assert next(loader)[0].shape == (4, index_copy.seq_len)
    assert loader.samples_consumed == 4
    loader.close()
