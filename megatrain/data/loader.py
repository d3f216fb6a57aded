"""Shards -> training batches: a deterministic, resumable sample order with async prefetch.

The model of the data stream, which everything here follows (for one shard version; a weighted
mixture of versions, mixture.py, replaces the first two points and keeps the rest):

* Epoch ``e`` is a permutation of all (shard, offset) pairs computed from ``(seed, e)`` alone:
  shards are shuffled, grouped into windows of ``shuffle_shards`` shards, and the samples of
  each window are shuffled together. A window's shards are read once, kept while the window is
  being consumed, then dropped; ``shuffle_shards=0`` makes one window (a full global permutation).
* An epoch is cut to ``U = (N // G) * G`` samples, where ``G = micro_batch_size * dp_size`` is one
  global batch (the incomplete tail batch is dropped); epochs follow each other forever.
* The stream position ``samples_consumed`` (global samples, skipped ones included) is the whole
  state: the batch at position ``p`` is a pure function of ``p``. Data-parallel rank ``r`` takes
  the contiguous slice ``[p + r*mb, p + (r+1)*mb)``; tensor-parallel peers pass the same
  ``dp_rank`` and get the same batch. Resume = restore ``p``; skip(n) = ``p += n`` (position.py
  keeps that bookkeeping for both loaders: this one and node_loader's).

The map from positions to (shard, offset) pairs is a ``StreamOrder`` (position.py): ``IndexOrder``
below for one version, ``MixtureOrder`` (mixture.py) for a mixture. BatchStream, the shard cache,
the prefetcher and the loaders only ever ask an order, so they serve either one unchanged.

A bad shard (missing, truncated, corrupt, checksum mismatch, or a token id outside the model's
vocabulary - a consistent checksum only says the bytes are those the index describes) raises
BadShardError naming it, the sample, the bad id and the reading rank, or with
``on_bad_shard="skip"`` is logged, counted in ``bad_shards`` and its samples are replaced by
samples of the next good shard in the same window (same offset modulo its size), so batch shapes
and the lockstep of ranks are kept without any communication. Token ids are checked once per
shard as it is decoded (one vectorised min/max), not per batch.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatrain import storage
from megatrain.data.index import BadShardError, ShardIndex
from megatrain.data.position import PositionedLoader, StreamOrder, continued_samples, cursor, epoch_length
from megatrain.data.shard_format import check_token_ids, decode_shard

log = logging.getLogger(__name__)


class SampleOrder:
    """Which (shard, offset) pair is sample ``i`` of epoch ``e``: a function of (seed, e, i)."""

    def __init__(self, counts: Sequence[int], seed: int, shuffle_shards: int) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed = seed & 0xFFFFFFFF  # SeedSequence wants non-negative entropy
        self.per_window = shuffle_shards or len(self.counts)
        self._epoch_cache: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
        self._window_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The shard ids of each window of ``epoch`` and the first sample index of each window."""
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            shards = rng.permutation(len(self.counts))
            groups = [shards[i:i + self.per_window] for i in range(0, len(shards), self.per_window)]
            starts = np.cumsum([0] + [int(self.counts[g].sum()) for g in groups])
            self._epoch_cache = {epoch: (groups, starts)}  # one epoch at a time is all we use
        return self._epoch_cache[epoch]

    def window_pairs(self, epoch: int, w: int) -> np.ndarray:
        """All (shard, offset) pairs of window ``w`` in their shuffled order: shape [n, 2]."""
        key = (epoch, w)
        if key not in self._window_cache:
            group = self.windows(epoch)[0][w]
            pairs = np.concatenate([np.stack([np.full(c, s), np.arange(c)], 1) for s, c in zip(group, self.counts[group])])
            rng = np.random.default_rng([self.seed, epoch, w + 1])
            self._window_cache[key] = pairs[rng.permutation(len(pairs))]
            while len(self._window_cache) > 4:  # a batch spans at most a few windows
                self._window_cache.popitem(last=False)
        return self._window_cache[key]

    def take(self, epoch: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Pairs of samples ``start..stop-1`` of ``epoch`` and the window each one belongs to."""
        _, starts = self.windows(epoch)
        pairs, window_ids = [], []
        w = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(starts[w + 1]))
            pairs.append(self.window_pairs(epoch, w)[start - starts[w]:end - starts[w]])
            window_ids.append(np.full(end - start, w))
            start, w = end, w + 1
        return np.concatenate(pairs), np.concatenate(window_ids)


class IndexOrder(StreamOrder):
    """One shard version's stream: epochs of ``epoch_len`` samples (the dropped-tail length of
    the first run's global batch), each a SampleOrder permutation; window keys (0, epoch, window).
    A stage that continues an earlier one on the same version (``start``'s cursor "data") serves
    that stream on from the earlier stage's position, under its epoch length."""

    NAME = "data"  # the one corpus as a component (the name data.components() gives it)

    def __init__(self, index: ShardIndex, seed: int, shuffle_shards: int, micro_batch_size: int,
                 dp_size: int, start: Any = None) -> None:
        super().__init__(index, seed, shuffle_shards, start)
        self.samples = SampleOrder([s.num_samples for s in index.shards], seed, shuffle_shards)
        self.epoch_len = epoch_length(index, micro_batch_size, dp_size)
        self.offset, note = continued_samples(self.start, self.NAME, self._cursor(0))
        if self.offset:
            self.epoch_len = int(self.start[self.NAME]["epoch_len"])  # the same stream, continued
        self.notes = [note] if note else []

    def _cursor(self, samples: int) -> dict[str, Any]:
        return cursor(version=self.version, seed=self.seed, shuffle_shards=self.shuffle_shards, mixture=False,
                      samples=samples, epoch_len=self.epoch_len)

    def pairs(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pairs, keys = [], []
        pos += self.offset
        while count:
            epoch, start = divmod(pos, self.epoch_len)
            n = min(count, self.epoch_len - start)  # a batch after skip(n) may straddle two epochs
            p, w = self.samples.take(epoch, start, start + n)
            pairs.append(p), keys.append(np.stack([np.zeros(n, np.int64), np.full(n, epoch), w], 1))
            pos, count = pos + n, count - n
        pairs_ = np.concatenate(pairs)
        return pairs_[:, 0], pairs_[:, 1], np.concatenate(keys)

    def window_shards(self, key: tuple[int, int, int]) -> np.ndarray:
        return self.samples.windows(key[1])[0][key[2]]

    def epoch(self, pos: int) -> int:
        return (pos + self.offset) // self.epoch_len

    def state_fields(self, pos: int) -> dict[str, Any]:
        return {"epoch_len": self.epoch_len}

    def cursors(self, pos: int) -> dict[str, dict[str, Any]]:
        return {**self.start, self.NAME: self._cursor(self.offset + pos)}

    def component_stats(self, pos: int) -> dict[str, dict[str, Any]]:
        """The one corpus as the single component "data"."""
        return {self.NAME: {"samples": pos, "tokens": pos * (self.source.seq_len + 1),
                            "epochs": (pos + self.offset) // self.epoch_len, "start": self.offset, "weight": 1.0}}

    def check_state(self, state: dict[str, Any]) -> None:
        if "mixture" in state:
            names = [c.get("name") for c in state["mixture"].get("components", [])]
            raise ValueError(f"loader state is of a data mixture (components {names}), this loader reads the "
                             f"single shard version {self.version!r}")

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch_len = int(state.get("epoch_len")
                             or epoch_length(self.source, state["micro_batch_size"], state["dp_size"]))


def stream_order(source: Any, *, seed: int, shuffle_shards: int, micro_batch_size: int,
                 dp_size: int, start: Any = None) -> StreamOrder:
    """The order of a ShardIndex, or the one a mixture (mixture.Mixture) makes of itself;
    ``start``: the previous stage's cursors (position.py), None at a campaign's start."""
    if isinstance(source, ShardIndex):
        return IndexOrder(source, seed, shuffle_shards, micro_batch_size, dp_size, start)
    return source.stream_order(seed=seed, shuffle_shards=shuffle_shards, start=start)


class ShardCache:
    """Reads, verifies and decodes whole shards (one read each) and keeps those still needed.

    ``index``: a ShardIndex, or a mixture.Mixture (the same attributes over all its components'
    shards). ``vocab_size``: token ids must be below it (the model's embedding rows; default the
    index's tokenizer size). ``rank``: named in a bad shard's message (the rank that read it)."""

    def __init__(self, index: ShardIndex, verify_checksums: bool, on_bad_shard: str, vocab_size: int | None = None,
                 rank: int | None = None) -> None:
        if on_bad_shard not in ("error", "skip"):
            raise ValueError(f"on_bad_shard must be 'error' or 'skip', got {on_bad_shard!r}")
        self.index, self.verify, self.skip_bad = index, verify_checksums, on_bad_shard == "skip"
        self.vocab_size = vocab_size if vocab_size is not None else index.vocab_size
        self.rank = rank
        self.shards: dict[int, np.ndarray] = {}
        self.bad: set[int] = set()
        self.reads = 0

    def _load(self, i: int) -> np.ndarray:
        info, url = self.index.shards[i], self.index.shard_url(i)
        try:
            data = storage.read_bytes(url)
        except storage.StorageError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise  # an outage, not a bad shard: transient, the attempt may be retried
            raise BadShardError(url, str(exc)) from exc
        self.reads += 1
        if len(data) != info.bytes:
            raise BadShardError(url, f"{len(data)} bytes, the index says {info.bytes} (truncated?)")
        if self.verify and hashlib.sha256(data).hexdigest() != info.sha256:
            raise BadShardError(url, "sha256 does not match the index (corrupt or replaced)")
        samples = decode_shard(url, data, info.num_samples, self.index.seq_len, self.index.np_dtype)
        check_token_ids(url, samples, self.vocab_size)
        return samples

    def get(self, i: int) -> np.ndarray | None:
        """Shard ``i``'s samples, or None if it is bad and bad shards are skipped."""
        if i in self.bad:
            return None
        if i not in self.shards:
            try:
                self.shards[i] = self._load(i)
            except BadShardError as found:
                exc = BadShardError(found.url, found.reason, self.rank)  # name the reading rank
                if not self.skip_bad:
                    raise exc from found
                self.bad.add(i)
                log.warning("skipping %s (%d bad shards so far)", exc, len(self.bad))
                return None
        return self.shards[i]

    def retain(self, keep: set[int]) -> None:
        for i in [i for i in self.shards if i not in keep]:
            del self.shards[i]


class BatchStream:
    """The batch at any stream position, for one or several data-parallel ranks."""

    def __init__(self, order: StreamOrder, cache: ShardCache, micro_batch_size: int, dp_size: int,
                 dp_ranks: Sequence[int]) -> None:
        self.order, self.cache, self.index = order, cache, order.source
        self.mb, self.dp_size, self.dp_ranks = micro_batch_size, dp_size, list(dp_ranks)
        self.global_batch = micro_batch_size * dp_size
        for r in self.dp_ranks:
            if not 0 <= r < dp_size:
                raise ValueError(f"dp_rank {r} is outside [0, dp_size={dp_size})")
        self._live: dict[int, frozenset] = {}  # lane -> the window keys its last batch touched

    @property
    def epoch_len(self) -> int | None:
        return self.order.epoch_len

    def _retain(self, keys: np.ndarray) -> None:
        """Keep the shards of the windows this batch touches; earlier windows are finished. Per
        lane: a mixture component absent from this batch keeps its window for its next sample."""
        live = dict(self._live)
        for lane in np.unique(keys[:, 0]).tolist():
            lane_keys = keys[keys[:, 0] == lane]
            live[lane] = frozenset(map(tuple, np.unique(lane_keys, axis=0).tolist()))
        if live != self._live:  # most batches stay inside the same windows: nothing to evict
            self._live = live
            self.cache.retain({int(s) for window in live.values() for key in window
                               for s in self.order.window_shards(key)})

    def _substitute(self, key: tuple[int, int, int], shard: int, offset: int) -> np.ndarray:
        group = [int(s) for s in self.order.window_shards(key)]
        start = group.index(shard)
        for other in group[start + 1:] + group[:start]:
            samples = self.cache.get(other)
            if samples is not None and len(samples):
                return samples[offset % len(samples)]
        raise BadShardError(self.index.shard_url(shard), f"every shard of its shuffle window (epoch {key[1]}) is bad")

    def batch(self, pos: int) -> np.ndarray:
        """Samples for each served rank at stream position ``pos``: [ranks, mb, seq_len + 1]."""
        shards, offsets, keys = self.order.pairs(pos, self.global_batch)
        self._retain(keys)
        out = np.empty((len(self.dp_ranks), self.mb, self.index.seq_len + 1), self.index.np_dtype)
        for k, rank in enumerate(self.dp_ranks):
            for j in range(self.mb):
                i = rank * self.mb + j
                shard, offset = int(shards[i]), int(offsets[i])
                samples = self.cache.get(shard)
                if samples is None:  # a bad shard, skipped: a deterministic stand-in sample
                    out[k, j] = self._substitute(tuple(keys[i].tolist()), shard, offset)
                else:
                    out[k, j] = samples[offset]
        return out


class _Prefetcher:
    """A thread computing batches from a start position into a bounded queue. Each item is the
    raw batch and ``convert(raw)`` (None without ``convert``): the tensors the training loop takes
    are made here, beside the reads, and not in the loop, which holds a GPU's queue while it waits
    (each conversion allocates and copies, and the thread that makes the next batch competes with it
    for the GIL: 0.5 to 10 ms a batch on the loop's side, measured with moe-gpu-2b's batches)."""

    def __init__(self, stream: BatchStream, start: int, depth: int, convert: Any = None) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.convert = convert
        self.thread = threading.Thread(target=self._run, args=(stream, start), name="megatrain-prefetch", daemon=True)
        self.thread.start()

    def _run(self, stream: BatchStream, pos: int) -> None:
        while not self.stop.is_set():
            try:
                raw = stream.batch(pos)
                item: Any = (raw, self.convert(raw) if self.convert is not None else None)
            except BaseException as exc:  # hand the failure to the consumer, who raises it
                item = exc
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            pos += stream.global_batch

    def get(self) -> tuple[np.ndarray, Any]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        # No timeout: a thread still inside batch() shares the shard cache with whatever runs
        # next, so it must finish first. A storage read that hangs forever is a hang for the
        # heartbeat watchdog to report, not something to race past.
        self.thread.join()


def to_tensors(window: np.ndarray, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[mb, seq_len + 1] tokens -> (inputs, targets), int64 [mb, seq_len] each; in page-locked
    memory with ``pin_memory`` (a GPU copies from it without the driver staging it first)."""
    tokens = torch.from_numpy(window.astype(np.int64))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if pin_memory:
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    return inputs, targets


class ShardLoader(PositionedLoader):
    """An endless iterator of ``(inputs, targets)`` micro-batches for one data-parallel rank (or,
    for the node loader, several). ``source``: a ShardIndex, or a mixture.Mixture of several."""

    def __init__(self, source: Any, *, micro_batch_size: int, dp_ranks: Sequence[int], dp_size: int,
                 seed: int, prefetch_batches: int = 4, on_bad_shard: str = "error", verify_checksums: bool = True,
                 shuffle_shards: int = 64, vocab_size: int | None = None, rank: int | None = None,
                 pin_device: torch.device | None = None, start: Any = None) -> None:
        self.prefetch_batches = prefetch_batches
        # page-locked memory only helps a copy to a GPU
        self.pin_device = pin_device if pin_device is not None and pin_device.type == "cuda" else None
        self.cache = ShardCache(source, verify_checksums, on_bad_shard, vocab_size, rank)
        order = stream_order(source, seed=seed, shuffle_shards=shuffle_shards, micro_batch_size=micro_batch_size,
                             dp_size=dp_size, start=start)
        if rank in (None, 0):  # where each component's order continues from the previous stage, once a run
            for note in order.notes:
                log.info(note)
        self.stream = BatchStream(order, self.cache, micro_batch_size, dp_size, dp_ranks)
        # Last, so that the cache's, the order's and the stream's checks of the arguments run first.
        super().__init__(order, micro_batch_size=micro_batch_size, dp_size=dp_size)
        self._prefetcher: _Prefetcher | None = None

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        raw, tensors = self._next()
        return tensors if tensors is not None else self._convert(raw)

    def next_raw(self) -> np.ndarray:
        """The next batch of every served rank, as stored: [ranks, mb, seq_len + 1]."""
        return self._next()[0]

    def _next(self) -> tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor] | None]:
        """The next raw batch, with its tensors where the prefetch thread made them."""
        if self.prefetch_batches == 0:
            item = self.stream.batch(self.samples_consumed), None
        else:
            if self._prefetcher is None:
                # one served rank: its tensors are made in the thread too (the node loader serves several from raw)
                convert = self._convert if len(self.stream.dp_ranks) == 1 else None
                self._prefetcher = _Prefetcher(self.stream, self.samples_consumed, self.prefetch_batches, convert)
            try:
                item = self._prefetcher.get()
            except BaseException:
                self.seek(self.samples_consumed)  # the thread has stopped; the next call retries from here
                raise
        self._advance()
        return item

    def _convert(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pin_device is None:
            return to_tensors(raw[0])
        # pinning allocates through the current device: the prefetch thread's would be GPU 0 on every rank
        with torch.cuda.device(self.pin_device):
            return to_tensors(raw[0], pin_memory=True)

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def seek(self, pos: int) -> None:
        """Move to stream position ``pos`` (global samples); prefetched batches are dropped, the
        cached shards stay. skip() and load_state_dict() use it, and so does the node loader."""
        self._stop_prefetch()
        super().seek(pos)

    def _restore_order(self, state: dict[str, Any]) -> None:
        self._stop_prefetch()  # the prefetch thread reads the order being changed
        super()._restore_order(state)

    @property
    def bad_shards(self) -> int:
        return len(self.cache.bad)

    def close(self) -> None:
        self.seek(self.samples_consumed)


def build_loader(source: Any, *, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 prefetch_batches: int = 4, on_bad_shard: str = "error", verify_checksums: bool = True,
                 shuffle_shards: int = 64, vocab_size: int | None = None, rank: int | None = None,
                 pin_device: torch.device | None = None, start: Any = None) -> ShardLoader:
    """The loader of data-parallel rank ``dp_rank``: ``next(loader) -> (inputs, targets)``.
    ``source``: a ShardIndex or a mixture.Mixture (mixture.build_mixture_loader builds one from
    components). ``vocab_size``: the model's (token ids must be below it); ``rank``: named in
    bad-shard errors; ``pin_device``: the device the batches go to; on a CUDA device they are made
    in page-locked memory; ``start``: the previous stage's cursors (``data.cursors``, position.py),
    where each component's own order continues."""
    return ShardLoader(source, micro_batch_size=micro_batch_size, dp_ranks=[dp_rank], dp_size=dp_size, seed=seed,
                       prefetch_batches=prefetch_batches, on_bad_shard=on_bad_shard,
                       verify_checksums=verify_checksums, shuffle_shards=shuffle_shards, vocab_size=vocab_size,
                       rank=rank, pin_device=pin_device, start=start)
