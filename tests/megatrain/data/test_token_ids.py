"""Token ids are checked where they enter: a shard whose checksum is consistent but which holds an
id outside the model's vocabulary is a bad shard (named: shard, sample, id, vocabulary, rank),
skipped and counted under on_bad_shard=skip, a deterministic InputError under error; the node
loader's clients fail with the reader's deterministic error."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from data_helpers import VOCAB, all_windows

from megatrain.data.index import BadShardError, write_index
from megatrain.data.loader import build_loader
from megatrain.data.shard_format import check_token_ids
from megatrain.data.node_loader import build_node_loader
from megatrain.data.shard_format import write_shard
from megatrain.errors import DeterministicError, InputError


def poison(index, shard: int, sample: int, bad_id: int):
    """Rewrite one shard with ``bad_id`` in one sample and republish the index with the new size
    and sha256: the checksums are consistent, only the ids are wrong. Returns the new index."""
    windows = all_windows(index)[shard].copy()
    windows[sample, 5] = bad_id
    info = write_shard(index.shard_url(shard), windows, first_key=0)
    info = dataclasses.replace(info, name=index.shards[shard].name)  # its name inside the version, folders kept
    shards = list(index.shards)
    shards[shard] = info
    poisoned = dataclasses.replace(index, shards=shards)
    write_index(poisoned)
    return poisoned


def epoch(loader, index) -> np.ndarray:
    return np.concatenate([next(loader)[0].numpy() for _ in range(index.num_samples // 4)])


def test_check_token_ids_names_the_first_bad_sample():
    samples = np.zeros((4, 9), np.int32)
    check_token_ids("s.tar", samples, 10)
    samples[2, 3], samples[3, 1] = 10, -1
    with pytest.raises(BadShardError, match=r"bad shard s.tar: sample 2 holds token id 10, outside the model's "
                                            r"vocabulary of 10 \(2 bad samples in this shard\)"):
        check_token_ids("s.tar", samples, 10)


@pytest.mark.parametrize("model_vocab", [VOCAB, None], ids=["model-vocab", "index-vocab-by-default"])
def test_error_mode_is_a_deterministic_error_naming_everything(index_copy, model_vocab):
    bad_id = VOCAB + 7
    index_copy = poison(index_copy, 2, sample=3, bad_id=bad_id)
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2,
                          shuffle_shards=0, vocab_size=model_vocab, rank=3)
    with pytest.raises(BadShardError) as failed:
        epoch(loader, index_copy)
    loader.close()
    assert isinstance(failed.value, InputError) and isinstance(failed.value, DeterministicError)
    text = str(failed.value)
    assert index_copy.shard_url(2) in text and "sample 3" in text and f"token id {bad_id}" in text
    assert f"vocabulary of {VOCAB}" in text and "read by rank 3" in text


def test_skip_mode_skips_counts_and_never_serves_the_bad_id(index_copy, caplog):
    index_copy = poison(index_copy, 1, sample=0, bad_id=60000)
    loader = build_loader(index_copy, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2,
                          on_bad_shard="skip", shuffle_shards=4, vocab_size=VOCAB, rank=0)
    with caplog.at_level(logging.WARNING, logger="megatrain.data.loader"):
        served = epoch(loader, index_copy)
    loader.close()
    assert int(served.max()) < VOCAB
    assert loader.bad_shards == 1 and loader.state_dict()["bad_shards"] == 1
    assert any(index_copy.shard_url(1) in r.getMessage() and "token id 60000" in r.getMessage() for r in caplog.records)


def test_the_node_loaders_clients_fail_deterministically_too(index_copy, tmp_path):
    """Local rank 0 reads and finds the bad id; local rank 1 (a thread here) learns it from the
    server and raises a deterministic error as well: no rank's error looks like a crash."""
    import threading

    index_copy = poison(index_copy, 0, sample=1, bad_id=VOCAB)
    common = dict(micro_batch_size=2, dp_size=2, seed=0, prefetch_batches=2, shuffle_shards=0, vocab_size=VOCAB,
                  channel=f"token-ids-{tmp_path.name}", timeout_s=30)
    errors: dict[int, BaseException] = {}

    def client() -> None:
        loader = build_node_loader(index_copy, local_rank=1, local_world_size=2, dp_rank=1, rank=1, **common)
        try:
            epoch(loader, index_copy)
        except BaseException as exc:
            errors[1] = exc
        loader.close()

    thread = threading.Thread(target=client)
    thread.start()
    server = build_node_loader(index_copy, local_rank=0, local_world_size=2, dp_rank=0, rank=0, **common)
    try:
        epoch(server, index_copy)
    except BaseException as exc:
        errors[0] = exc
    server.close()
    thread.join(30)
    assert isinstance(errors[0], BadShardError) and "read by rank 0" in str(errors[0])
    assert isinstance(errors[1], InputError) and "local rank 1, read by local rank 0" in str(errors[1])
    assert f"token id {VOCAB}" in str(errors[1]) and index_copy.shard_url(0) in str(errors[1])
