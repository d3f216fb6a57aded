"""Where a loader stands in the sample stream, and the state that puts it back there.

Every loader serves a stream of samples: the batch at stream position ``p`` (global samples
consumed, all data-parallel ranks together) is a pure function of ``p`` and of the values that fix
the sample order. A ``StreamOrder`` holds those values and maps positions to samples; there are
two: one shard version (``IndexOrder``, loader.py) and a weighted mixture of versions
(``MixtureOrder``, mixture.py). A loader's whole state is its position plus the identity of its
order, and resuming is restoring the position. ShardLoader (one reader per rank) and the node
loaders (one reader per node, node_loader.py) differ in how they read batches, not in this
bookkeeping: both build on ``PositionedLoader``, so either one can restore the other's state.

Stages continue the data. A campaign's stage is a new loader at its position 0, but each data
component's own sample order goes on where the previous stage left it: the loader is built with
the previous stage's *cursors* (``start``), one per component, and offsets its component's samples
by them. A cursor is plain JSON:

    {"version": shard version, "seed": data.seed, "shuffle_shards": ..., "mixture": a mixture
     component (its order is seeded by seed and name) or the single version,
     "samples": its own samples consumed so far, "epoch_len": samples of one of its epochs}

so ``samples // epoch_len`` is the component's epoch and ``samples % epoch_len`` the next sample of
it. A cursor applies only to the same order (version, seed, shuffle window and kind: otherwise its
samples are other samples, and the component starts at 0, said in ``notes``). Components of the
cursors that this loader does not serve are carried on unchanged, so a later stage that takes one
up again continues it too. The state saves both ``start`` (as given: a resume must be built with
the same, and is refused otherwise, so an offset is never added twice) and ``cursors``, where each
component stands at the state's position: what the next stage starts from (``end_cursors``).
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

CURSOR_KEYS = ("version", "seed", "shuffle_shards", "mixture", "samples", "epoch_len")


def as_cursors(value: Any) -> dict[str, dict[str, Any]]:
    """Cursors as plain dicts by component name, from None, dicts or config sections (data.cursors);
    ValueError naming the component and key of a malformed one."""
    out: dict[str, dict[str, Any]] = {}
    for name, cursor in (value or {}).items():
        plain = cursor.model_dump(mode="json") if hasattr(cursor, "model_dump") else dict(cursor)
        missing = [key for key in CURSOR_KEYS if key not in plain]
        if missing:
            raise ValueError(f"data cursor of component {name!r} lacks {', '.join(missing)}")
        if int(plain["samples"]) < 0 or int(plain["epoch_len"]) <= 0:
            raise ValueError(f"data cursor of component {name!r}: samples must be >= 0 and epoch_len > 0, "
                             f"got {plain['samples']} and {plain['epoch_len']}")
        out[str(name)] = {key: plain[key] for key in CURSOR_KEYS}
    return out


def cursor(*, version: str, seed: int, shuffle_shards: int, mixture: bool, samples: int,
           epoch_len: int) -> dict[str, Any]:
    """One component's cursor (see the module docstring)."""
    return {"version": version, "seed": int(seed), "shuffle_shards": int(shuffle_shards), "mixture": bool(mixture),
            "samples": int(samples), "epoch_len": int(epoch_len)}


def continued_samples(start: dict[str, dict[str, Any]], name: str, mine: dict[str, Any]) -> tuple[int, str | None]:
    """How many of its own samples component ``name`` skips at this stage's start, and what to
    say about it: ``start``'s cursor of that name when its order is ``mine`` (a cursor of this
    loader's order at sample 0), else 0 with the reason."""
    given = start.get(name)
    if given is None:
        return 0, None
    differs = [f"{key} {given[key]!r} -> {mine[key]!r}" for key in ("version", "seed", "shuffle_shards", "mixture")
               if given[key] != mine[key]]
    if not differs and given["epoch_len"] != mine["epoch_len"] and mine["mixture"]:
        differs.append(f"epoch_len {given['epoch_len']} -> {mine['epoch_len']}")
    if differs:
        return 0, (f"data component {name!r} starts at its sample 0: the previous stage's cursor is of another "
                   f"sample order ({'; '.join(differs)})")
    samples = int(given["samples"])
    return samples, (f"data component {name!r} continues at its sample {samples:,} (epoch {samples // int(given['epoch_len'])}, "
                     f"sample {samples % int(given['epoch_len']):,} of {int(given['epoch_len']):,})")


def end_cursors(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Where each data component stands at a loader state's position (a stage's final data
    position: what the next stage continues). States saved before cursors existed started every
    component at 0, and their cursors follow from their counts."""
    if state.get("cursors") is not None:
        return as_cursors(state["cursors"])
    common = {"seed": state["seed"], "shuffle_shards": state["shuffle_shards"]}
    if state.get("mixture") is not None:
        counts = state.get("components") or {}
        return {c["name"]: cursor(version=c["version"], mixture=True, samples=counts[c["name"]]["samples"],
                                  epoch_len=c["samples"], **common)
                for c in state["mixture"]["components"]}
    return {"data": cursor(version=state["version"], mixture=False, samples=state["samples_consumed"],
                           epoch_len=state["epoch_len"], **common)}


def describe_start(start: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{name} at sample {c['samples']:,} of {c['version']}" for name, c in start.items()) or "sample 0"


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

    def __init__(self, source: Any, seed: int, shuffle_shards: int, start: Any = None) -> None:
        self.source, self.seed, self.shuffle_shards = source, seed, shuffle_shards
        self.start = as_cursors(start)  # the previous stage's cursors, as given (module docstring)
        self.notes: list[str] = []  # per component of start: continued where, or why not

    def cursors(self, pos: int) -> dict[str, dict[str, Any]]:
        """Each component's cursor at ``pos`` (the start's other components carried on as given)."""
        raise NotImplementedError

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
        """Per component, what the first ``pos`` samples used: {name: {samples, tokens (both this
        stage's), epochs (completed in the component's own order, earlier stages included), start
        (its own samples consumed before this stage), weight}}; one version is the single component "data"."""
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
        state["start"], state["cursors"] = self.order.start, self.order.cursors(self._pos)
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
        if as_cursors(state.get("start")) != self.order.start:  # the offsets of another stage start
            raise ValueError(f"loader state began its stage with the data at {describe_start(as_cursors(state.get('start')))}"
                             f", this loader begins at {describe_start(self.order.start)} (data.cursors)")
        self._restore_order(state)
        self._skipped = int(state["samples_skipped"])
        self.seek(int(state["samples_consumed"]))
