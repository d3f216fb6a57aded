"""Where a loader stands in the sample stream, and the state that puts it back there.

Every loader serves a stream of samples: the batch at stream position ``p`` (global samples
consumed, all data-parallel ranks together) is a pure function of ``p`` and of the values that fix
the sample order. A ``StreamOrder`` holds those values and maps positions to samples; there are
two: one shard version (``IndexOrder``, loader.py) and a weighted mixture of versions
(``MixtureOrder``, mixture.py). A loader's whole state is its position plus the identity of its
order, and resuming is restoring the position. ShardLoader (one reader per rank) and the node
loaders (one reader per node, node_loader.py) differ in how they read batches, not in this
bookkeeping: both build on ``PositionedLoader``, so either one can restore the other's state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatrain.data.index import DataError, ShardIndex

STATE_FORMAT = 1

# What fixes the sample order: a state saved under other values would mean other samples. The
# split of a global batch over DP ranks and micro-batches does not: sample ``p`` of the stream is
# the same for every (dp_size, micro_batch_size), once the epoch length is the saver's. An order
# adds its own keys (a mixture its components and weights) and checks them in ``check_state``.
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


class StreamOrder:
    """Which stored sample sits at each stream position, and what a saved state must match.

    ``source`` is index-like (a ShardIndex, or a Mixture's view over its components' shards):
    ``shards``, ``shard_url(i)``, ``seq_len``, ``np_dtype``, ``vocab_size``, ``version``. Shard ids
    are indices into ``source.shards``. Samples are read a shuffle window at a time; a window is
    named by a key ``(lane, epoch, window)``: the lane is 0 for a single version and the
    component's number in a mixture, whose components each walk their own windows side by side.
    """

    # Samples of one epoch of the whole stream, or None where epochs are per component (a mixture).
    epoch_len: int | None = None

    def __init__(self, source: Any, seed: int, shuffle_shards: int) -> None:
        self.source, self.seed, self.shuffle_shards = source, seed, shuffle_shards

    @property
    def version(self) -> str:
        return self.source.version

    def pairs(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shard ids [count], offsets [count] and window keys [count, 3] of positions pos..pos+count-1."""
        raise NotImplementedError

    def window_shards(self, key: tuple[int, int, int]) -> np.ndarray:
        """The shard ids of one window, in the window's order (a bad shard's stand-in is the next)."""
        raise NotImplementedError

    def epoch(self, pos: int) -> int:
        """The epoch the sample at ``pos`` belongs to."""
        raise NotImplementedError

    def state_fields(self, pos: int) -> dict[str, Any]:
        """This order's own entries of a loader's state_dict (plain, JSON-able)."""
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse, with a message that says what differs, a state saved under another order."""

    def restore(self, state: dict[str, Any]) -> None:
        """Adopt what the saver's run fixed and this one would compute otherwise (an epoch length)."""

    def component_stats(self, pos: int) -> dict[str, dict[str, Any]]:
        """Per component, what the first ``pos`` samples used: {name: {samples, tokens, epochs
        (completed), weight}}; one version is the single component "data"."""
        raise NotImplementedError


class PositionedLoader:
    """The position of a loader's caller in the stream, and the state_dict that saves it.

    Subclasses read the batches (and provide ``__next__``); they move the position only through
    ``_advance()`` and ``seek()``, and override ``seek()`` when they have batches to drop.
    """

    def __init__(self, order: StreamOrder, *, micro_batch_size: int, dp_size: int) -> None:
        self.order = order
        self.seed, self.shuffle_shards = order.seed, order.shuffle_shards
        self.micro_batch_size, self.dp_size = micro_batch_size, dp_size
        self.global_batch = micro_batch_size * dp_size
        self._pos = 0  # global samples handed to our caller (batches read ahead not counted)
        self._skipped = 0

    def __iter__(self) -> PositionedLoader:
        return self

    @property
    def samples_consumed(self) -> int:
        """Global samples behind us (all ranks together), skipped ones included."""
        return self._pos

    @property
    def epoch_len(self) -> int | None:
        return self.order.epoch_len

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (a mixture: the most-repeated component's)."""
        return self.order.epoch(self._pos)

    @property
    def bad_shards(self) -> int:
        """Shards found bad so far (skipped, with ``on_bad_shard="skip"``)."""
        raise NotImplementedError

    def component_stats(self) -> dict[str, dict[str, Any]]:
        """Per component (a mixture's, or "data" for one version): samples and tokens served so far,
        completed epochs, weight: for metrics."""
        return self.order.component_stats(self._pos)

    def _advance(self) -> None:
        """The caller took one batch: every data-parallel rank consumed its micro-batch of it."""
        self._pos += self.global_batch

    def seek(self, pos: int) -> None:
        """Move to stream position ``pos`` (global samples)."""
        self._pos = pos

    def _restore_order(self, state: dict[str, Any]) -> None:
        """Adopt the saver's order (subclasses first stop whatever reads ahead with the old one)."""
        self.order.restore(state)

    def skip(self, n_samples: int) -> None:
        """Jump over ``n_samples`` global samples (anomaly rollback skips the offending window)."""
        if n_samples < 0:
            raise ValueError(f"skip: n_samples must be >= 0, got {n_samples}")
        self._skipped += n_samples
        self.seek(self._pos + n_samples)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings (JSON-able), the same on every rank."""
        state = {"format": STATE_FORMAT, "version": self.order.version, "seed": self.seed, "dp_size": self.dp_size,
                 "micro_batch_size": self.micro_batch_size, "shuffle_shards": self.shuffle_shards,
                 "samples_consumed": self._pos, "samples_skipped": self._skipped, "epoch": self.epoch}
        state.update(self.order.state_fields(self._pos))
        state["bad_shards"] = self.bad_shards
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saver stopped, whatever its DP size and micro-batch: the
        position is global, and each DP rank takes its slice of the next global batch. The epoch
        length stays the saver's (the first run's), so every later position means the same sample.
        A state of another shard version, mixture, seed or shuffle window is refused rather than
        reinterpreted as other samples."""
        self.order.check_state(state)  # first: its message names what differs (a mixture's components)
        mine = self.state_dict()
        for key in ORDER_KEYS:
            if state.get(key) != mine[key]:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader has {key}={mine[key]!r}")
        self._restore_order(state)
        self._skipped = int(state["samples_skipped"])
        self.seek(int(state["samples_consumed"]))
