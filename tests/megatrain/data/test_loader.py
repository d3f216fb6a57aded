"""The loader: exact windows in a deterministic order, rank slicing, resume, skip, prefetch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_helpers import SEQ_LEN, all_windows

from megatrain.data.index import DataError
from megatrain.data.loader import SampleOrder, build_loader


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def expected_batch(index, windows, pos: int, mb: int, dp_rank: int, dp_size: int, seed: int, shuffle: int) -> np.ndarray:
    """The contract written out: stream position -> (epoch, i) -> order pair -> stored window."""
    order = SampleOrder([s.num_samples for s in index.shards], seed, shuffle)
    epoch_len = (index.num_samples // (mb * dp_size)) * (mb * dp_size)
    rows = []
    for p in range(pos + dp_rank * mb, pos + (dp_rank + 1) * mb):
        epoch, i = divmod(p, epoch_len)
        (shard, offset), = order.take(epoch, i, i + 1)[0]
        rows.append(windows[shard][offset])
    return np.stack(rows)


def test_order_is_a_seeded_permutation_per_epoch(small_index):
    counts = [s.num_samples for s in small_index.shards]
    n = sum(counts)
    for shuffle in (0, 3):
        order = SampleOrder(counts, seed=5, shuffle_shards=shuffle)
        epochs = [order.take(e, 0, n)[0] for e in range(2)]
        for pairs in epochs:
            assert len({tuple(p) for p in pairs.tolist()}) == n  # every (shard, offset) exactly once
        assert not np.array_equal(epochs[0], epochs[1])
        np.testing.assert_array_equal(SampleOrder(counts, 5, shuffle).take(1, 0, n)[0], epochs[1])
        assert not np.array_equal(SampleOrder(counts, 6, shuffle).take(0, 0, n)[0], epochs[0])
    # windows of 3 shards: each window's samples come from its own 3 shards only
    order = SampleOrder(counts, seed=5, shuffle_shards=3)
    groups, starts = order.windows(0)
    pairs, windows = order.take(0, 0, n)
    for w, group in enumerate(groups):
        assert set(pairs[windows == w][:, 0].tolist()) == set(group.tolist())
        assert (windows == w).sum() == starts[w + 1] - starts[w]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_ranks_get_exact_windows_and_together_cover_the_epoch(small_index, dp_size):
    windows = all_windows(small_index)
    mb, seed, shuffle = 4, 11, 3
    global_batch = mb * dp_size
    steps = small_index.num_samples // global_batch
    seen = []
    for rank in range(dp_size):
        loader = build_loader(small_index, micro_batch_size=mb, dp_rank=rank, dp_size=dp_size, seed=seed,
                              prefetch_batches=2, shuffle_shards=shuffle)
        for step in range(steps + 2):  # two batches into the next epoch
            inputs, targets = next(loader)
            window = expected_batch(small_index, windows, step * global_batch, mb, rank, dp_size, seed, shuffle)
            np.testing.assert_array_equal(inputs.numpy(), window[:, :-1])
            np.testing.assert_array_equal(targets.numpy(), window[:, 1:])
            if step < steps:
                seen.append(inputs)
        assert loader.epoch == 1 and loader.samples_consumed == (steps + 2) * global_batch
        loader.close()
    # union over ranks = one full epoch without the dropped tail, no duplicates
    order = SampleOrder([s.num_samples for s in small_index.shards], seed, shuffle)
    epoch_pairs = order.take(0, 0, steps * global_batch)[0]
    assert len({tuple(p) for p in epoch_pairs.tolist()}) == steps * global_batch
    assert sum(len(x) for x in seen) == steps * global_batch == small_index.num_samples - small_index.num_samples % global_batch


def test_batches_are_int64_shifted_pairs(small_index):
    loader = build_loader(small_index, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0, prefetch_batches=0)
    inputs, targets = next(loader)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (3, SEQ_LEN)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < small_index.vocab_size


def test_same_seed_same_batches_prefetch_or_not(small_index):
    """The prefetch thread makes the tensors too: the same inputs and targets as made in the loop."""
    def run(prefetch: int, seed: int) -> list:
        loader = build_loader(small_index, micro_batch_size=4, dp_rank=1, dp_size=2, seed=seed, prefetch_batches=prefetch)
        out = [torch.cat([x, y]) for x, y in take(loader, 20)]
        loader.close()
        return out
    a, b, c = run(0, 3), run(4, 3), run(4, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_raw_and_tensor_batches_interleave_in_stream_order(small_index):
    """next_raw() drops the tensors the thread made for its batch: a later next() is the next batch."""
    mb = 3
    plain = build_loader(small_index, micro_batch_size=mb, dp_rank=0, dp_size=1, seed=5, prefetch_batches=0)
    mixed = build_loader(small_index, micro_batch_size=mb, dp_rank=0, dp_size=1, seed=5, prefetch_batches=2)
    for i in range(6):
        want_x, want_y = next(plain)
        if i % 2:
            got = torch.from_numpy(mixed.next_raw()[0].astype(np.int64))
            assert torch.equal(got[:, :-1], want_x) and torch.equal(got[:, 1:], want_y)
        else:
            got_x, got_y = next(mixed)
            assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)
    mixed.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_cpu_pin_device_gets_the_plain_batches(small_index, prefetch):
    """Page-locked memory is for copies to a GPU: a CPU device (a trainer on CPU) is served as without one."""
    loader = build_loader(small_index, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0, prefetch_batches=prefetch,
                          pin_device=torch.device("cpu"))
    plain = build_loader(small_index, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0, prefetch_batches=0)
    for _ in range(3):
        (x, y), (want_x, want_y) = next(loader), next(plain)
        assert torch.equal(x, want_x) and torch.equal(y, want_y) and not x.is_pinned()
    loader.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [0, 2])
def test_batches_for_a_gpu_are_pinned(small_index, prefetch):
    loader = build_loader(small_index, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0, prefetch_batches=prefetch,
                          pin_device=torch.device("cuda", 0))
    plain = build_loader(small_index, micro_batch_size=3, dp_rank=0, dp_size=1, seed=0, prefetch_batches=0)
    for _ in range(3):
        (x, y), (want_x, want_y) = next(loader), next(plain)
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
    loader.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_is_exact_including_across_an_epoch_boundary(small_index, prefetch):
    mb, dp_size, seed = 4, 2, 21
    steps_per_epoch = small_index.num_samples // (mb * dp_size)
    kwargs = dict(micro_batch_size=mb, dp_rank=1, dp_size=dp_size, seed=seed, prefetch_batches=prefetch, shuffle_shards=2)
    reference = build_loader(small_index, **kwargs)
    uninterrupted = [x for x, _ in take(reference, steps_per_epoch + 5)]
    reference.close()
    for k in (3, steps_per_epoch - 2):  # the second resume point crosses into epoch 1
        first = build_loader(small_index, **kwargs)
        take(first, k)
        state = json.loads(json.dumps(first.state_dict()))  # plain ints and strings survive JSON
        first.close()
        resumed = build_loader(small_index, **kwargs)
        resumed.load_state_dict(state)
        assert resumed.samples_consumed == k * mb * dp_size
        for expected in uninterrupted[k:k + 7]:
            assert torch.equal(next(resumed)[0], expected)
        resumed.close()


def test_skip_jumps_exactly_n_global_samples(small_index):
    windows = all_windows(small_index)
    kwargs = dict(micro_batch_size=2, dp_size=2, seed=8, shuffle_shards=4)
    loader = build_loader(small_index, dp_rank=1, prefetch_batches=3, **kwargs)
    take(loader, 5)
    loader.skip(13)  # not a multiple of the global batch: later batches straddle differently
    assert loader.samples_consumed == 5 * 4 + 13
    state = loader.state_dict()
    assert state["samples_skipped"] == 13 and state["samples_consumed"] == 33
    inputs, _ = next(loader)
    np.testing.assert_array_equal(inputs.numpy(), expected_batch(small_index, windows, 33, 2, 1, 2, 8, 4)[:, :-1])
    # skipping past the end of the epoch lands in the next one, batch boundaries included
    epoch_len = (small_index.num_samples // 4) * 4
    loader.skip(epoch_len - loader.samples_consumed - 3)  # 3 samples before the epoch ends
    inputs, _ = next(loader)
    np.testing.assert_array_equal(inputs.numpy(), expected_batch(small_index, windows, epoch_len - 3, 2, 1, 2, 8, 4)[:, :-1])
    assert loader.epoch == 1
    resumed = build_loader(small_index, dp_rank=1, prefetch_batches=0, **kwargs)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(resumed)[0], next(loader)[0])
    loader.close()


def test_state_from_another_order_is_refused(small_index):
    loader = build_loader(small_index, micro_batch_size=2, dp_rank=0, dp_size=1, seed=1, prefetch_batches=0)
    state = loader.state_dict()
    other = build_loader(small_index, micro_batch_size=2, dp_rank=0, dp_size=1, seed=2, prefetch_batches=0)
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_loader(small_index, micro_batch_size=small_index.num_samples, dp_rank=0, dp_size=2, seed=1)
    with pytest.raises(ValueError, match="dp_rank 2 is outside"):
        build_loader(small_index, micro_batch_size=2, dp_rank=2, dp_size=2, seed=1)


def test_each_shard_is_read_once_per_epoch(small_index):
    n_shards = len(small_index.shards)
    windowed = build_loader(small_index, micro_batch_size=4, dp_rank=0, dp_size=1, seed=3, prefetch_batches=0, shuffle_shards=3)
    steps = small_index.num_samples // 4
    take(windowed, steps)
    assert windowed.cache.reads == n_shards
    assert len(windowed.cache.shards) <= 3  # only the current window stays in memory
    take(windowed, steps)
    # at most once more per epoch (a shard in both the last and the next first window stays cached)
    assert 2 * n_shards - 3 <= windowed.cache.reads <= 2 * n_shards
    windowed.close()
    glob = build_loader(small_index, micro_batch_size=4, dp_rank=0, dp_size=1, seed=3, prefetch_batches=0, shuffle_shards=0)
    take(glob, 2 * steps)
    assert glob.cache.reads == n_shards  # one global window: everything stays cached
