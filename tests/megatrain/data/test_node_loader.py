"""One reader per node: 4 spawned local ranks, storage read once, every rank its exact batch."""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from counting_fs import PROTOCOL, opens

from megatrain.data.loader import build_loader
from megatrain.data.node_loader import _names

LOCAL_RANKS = 4
MB, DP_SIZE, SEED = 2, 2, 9  # local ranks 0,1 are tensor-parallel peers of dp rank 0; 2,3 of dp rank 1


def script(loader, epoch_len: int) -> tuple[list[np.ndarray], dict]:
    """The same calls on every rank: 3 batches, a skip to 3 samples before the epoch's end (the
    next batch straddles two epochs), 3 batches, then a restore to an earlier state and 2 more."""
    out = [next(loader)[0].numpy() for _ in range(3)]
    saved = loader.state_dict()
    loader.skip(epoch_len - loader.samples_consumed - 3)
    out += [next(loader)[0].numpy() for _ in range(3)]
    final = loader.state_dict()
    loader.load_state_dict(saved)
    out += [next(loader)[0].numpy() for _ in range(2)]
    return out, final


def local_rank_main(local_rank: int, index_url: str, out_dir: str, log_path: str, channel: str) -> None:
    """One spawned local rank: storage goes through countfile://, which logs every open."""
    import counting_fs

    from megatrain.data.node_loader import build_node_loader
    from megatrain.data.shard import load_index

    counting_fs.register()
    os.environ["MEGATRAIN_TEST_OPEN_LOG"] = log_path
    index = load_index(index_url)
    loader = build_node_loader(index, local_rank=local_rank, local_world_size=LOCAL_RANKS, micro_batch_size=MB,
                               dp_rank=local_rank // 2, dp_size=DP_SIZE, seed=SEED, prefetch_batches=2,
                               shuffle_shards=0, channel=channel, timeout_s=120)
    batches, state = script(loader, loader.epoch_len)
    loader.close()
    np.save(Path(out_dir) / f"rank{local_rank}.npy", np.stack(batches))
    (Path(out_dir) / f"rank{local_rank}.json").write_text(json.dumps({"pid": os.getpid(), "state": state}))


@pytest.mark.slow
def test_node_loader_reads_once_and_feeds_every_local_rank(small_index, tmp_path):
    log_path = str(tmp_path / "opens.log")
    channel = f"test-{uuid.uuid4().hex}"
    context = multiprocessing.get_context("spawn")
    index_url = f"{PROTOCOL}://{small_index.url}"  # every storage open is logged
    ranks = [context.Process(target=local_rank_main, args=(r, index_url, str(tmp_path), log_path, channel))
             for r in range(LOCAL_RANKS)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(180)
    assert [p.exitcode for p in ranks] == [0] * LOCAL_RANKS

    epoch_len = (small_index.num_samples // (MB * DP_SIZE)) * MB * DP_SIZE
    results = [np.load(tmp_path / f"rank{r}.npy") for r in range(LOCAL_RANKS)]
    meta = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(LOCAL_RANKS)]
    for r in range(LOCAL_RANKS):
        single = build_loader(small_index, micro_batch_size=MB, dp_rank=r // 2, dp_size=DP_SIZE, seed=SEED,
                              prefetch_batches=0, shuffle_shards=0)
        expected, state = script(single, epoch_len)
        np.testing.assert_array_equal(results[r], np.stack(expected))
        assert meta[r]["state"] == state and state["epoch"] == 1
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[2], results[3])
    assert not np.array_equal(results[0], results[2])

    shard_opens = [(pid, path) for pid, path in opens(log_path) if path.endswith(".tar")]
    assert {pid for pid, _ in shard_opens} == {meta[0]["pid"]}  # only local rank 0 touched shards
    paths = [path for _, path in shard_opens]
    assert paths and len(paths) == len(set(paths))  # each shard read once, for all four ranks
    assert set(paths) <= {small_index.shard_url(i) for i in range(len(small_index.shards))}
    socket_path, ring_path, _ = _names(channel)
    assert not os.path.exists(socket_path) and not os.path.exists(ring_path)  # cleaned up on close


def test_single_local_rank_works_without_clients(small_index):
    from megatrain.data.node_loader import build_node_loader

    loader = build_node_loader(small_index, local_rank=0, local_world_size=1, micro_batch_size=3, dp_rank=1,
                               dp_size=2, seed=4, channel=f"solo-{uuid.uuid4().hex}", timeout_s=10)
    reference = build_loader(small_index, micro_batch_size=3, dp_rank=1, dp_size=2, seed=4, prefetch_batches=0)
    for _ in range(5):
        assert torch.equal(next(loader)[0], next(reference)[0])
    loader.skip(5)
    reference.skip(5)
    assert torch.equal(next(loader)[1], next(reference)[1])
    assert loader.state_dict() == reference.state_dict()
    loader.close()


def test_local_ranks_that_disagree_fail_clearly(small_index):
    """Local rank 0 in a thread, local rank 1 here: a different seed is refused on both sides."""
    import threading

    from megatrain.data.index import DataError
    from megatrain.data.node_loader import build_node_loader

    channel, errors = f"mismatch-{uuid.uuid4().hex}", []
    common = dict(local_world_size=2, micro_batch_size=2, dp_rank=0, dp_size=1, channel=channel, timeout_s=20)

    def server() -> None:
        try:
            build_node_loader(small_index, local_rank=0, seed=1, **common)
        except DataError as exc:
            errors.append(exc)

    thread = threading.Thread(target=server)
    thread.start()
    with pytest.raises(DataError, match="has loader params .*'seed': 2.*local rank 0 has .*'seed': 1"):
        build_node_loader(small_index, local_rank=1, seed=2, **common)
    thread.join(20)
    assert errors and "disagrees on loader params" in str(errors[0])
