"""Where a loader stands in the sample stream, and the state that puts it back there.

Every loader serves the same stream (loader.py describes it): the batch at stream position ``p``
is a pure function of ``p`` and of the values that fix the sample order (shard version, seed,
batch layout, shuffle window). So a loader's whole state is its position plus those values, and
resuming is restoring the position. ShardLoader (one reader per rank) and the node loaders (one
reader per node, node_loader.py) differ in how they read batches, not in this bookkeeping: both
build on ``PositionedLoader``, so either one can restore the other's state.
"""

from __future__ import annotations

from typing import Any

from megatrain.data.index import DataError, ShardIndex

STATE_FORMAT = 1

# What fixes the sample order: a state saved under other values would mean other samples. The
# split of a global batch over DP ranks and micro-batches does not: sample ``p`` of the stream is
# the same for every (dp_size, micro_batch_size), once the epoch length is the saver's.
ORDER_KEYS = ("format", "version", "seed", "shuffle_shards")


def epoch_length(index: ShardIndex, micro_batch_size: int, dp_size: int) -> int:
    """Samples of one epoch, ``(N // G) * G`` for a global batch of ``G``: the incomplete tail
    batch is dropped, so every rank sees full batches and the ranks stay in lockstep."""
    global_batch = micro_batch_size * dp_size
    epoch_len = (index.num_samples // global_batch) * global_batch
    if epoch_len == 0:
        raise DataError(f"{index.url}: {index.num_samples} samples, fewer than one global batch "
                        f"(micro_batch_size {micro_batch_size} x dp_size {dp_size})")
    return epoch_len


class PositionedLoader:
    """The position of a loader's caller in the stream, and the state_dict that saves it.

    Subclasses read the batches (and provide ``__next__``); they move the position only through
    ``_advance()`` and ``seek()``, and override ``seek()`` when they have batches to drop.
    """

    def __init__(self, index: ShardIndex, *, micro_batch_size: int, dp_size: int, seed: int,
                 shuffle_shards: int) -> None:
        self.index, self.seed, self.shuffle_shards = index, seed, shuffle_shards
        self.micro_batch_size, self.dp_size = micro_batch_size, dp_size
        self.global_batch = micro_batch_size * dp_size
        self.epoch_len = epoch_length(index, micro_batch_size, dp_size)
        self._pos = 0  # global samples handed to our caller (batches read ahead not counted)
        self._skipped = 0

    def __iter__(self) -> PositionedLoader:
        return self

    @property
    def samples_consumed(self) -> int:
        """Global samples behind us (all ranks together), skipped ones included."""
        return self._pos

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._pos // self.epoch_len

    @property
    def bad_shards(self) -> int:
        """Shards found bad so far (skipped, with ``on_bad_shard="skip"``)."""
        raise NotImplementedError

    def _advance(self) -> None:
        """The caller took one batch: every data-parallel rank consumed its micro-batch of it."""
        self._pos += self.global_batch

    def seek(self, pos: int) -> None:
        """Move to stream position ``pos`` (global samples)."""
        self._pos = pos

    def _set_epoch_len(self, epoch_len: int) -> None:
        """Adopt a restored run's epoch length (subclasses pass it to their batch streams)."""
        self.epoch_len = epoch_len

    def skip(self, n_samples: int) -> None:
        """Jump over ``n_samples`` global samples (anomaly rollback skips the offending window)."""
        if n_samples < 0:
            raise ValueError(f"skip: n_samples must be >= 0, got {n_samples}")
        self._skipped += n_samples
        self.seek(self._pos + n_samples)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings (JSON-able), the same on every rank."""
        return {"format": STATE_FORMAT, "version": self.index.version, "seed": self.seed, "dp_size": self.dp_size,
                "micro_batch_size": self.micro_batch_size, "shuffle_shards": self.shuffle_shards,
                "samples_consumed": self._pos, "samples_skipped": self._skipped, "epoch": self.epoch,
                "epoch_len": self.epoch_len, "bad_shards": self.bad_shards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saver stopped, whatever its DP size and micro-batch: the
        position is global, and each DP rank takes its slice of the next global batch. The epoch
        length stays the saver's (the first run's), so every later position means the same sample.
        A state of another shard version, seed or shuffle window is refused rather than
        reinterpreted as other samples."""
        mine = self.state_dict()
        for key in ORDER_KEYS:
            if state.get(key) != mine[key]:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader has {key}={mine[key]!r}")
        saved_len = state.get("epoch_len") or epoch_length(self.index, state["micro_batch_size"], state["dp_size"])
        self._set_epoch_len(int(saved_len))
        self._skipped = int(state["samples_skipped"])
        self.seek(int(state["samples_consumed"]))
