"""Weighted mixtures of shard versions (web 0.5, code 0.3, books 0.2) with exact, layout-free resume.

The stream model (loader.py's, with the mixture in place of the single version):

* Sample ``p`` of the global stream belongs to component ``c(p)`` and is that component's own
  sample ``k = count_c(p)`` (its samples among the first ``p``): both a pure function of
  (weights, seed, p), held to the weights at every prefix and computed in O(1) for any ``p``
  (interleave.py: weights kept to 1/10,000, ``|count_c(p) - p w_c| < 1 + p/10,000``).
* Each component is its own endless stream: its sample ``j = o_c + k`` is sample ``j % N_c`` of
  its epoch ``j // N_c`` (``N_c`` its samples; no tail dropped), through its own ``SampleOrder``
  (shuffle windows of ``shuffle_shards`` of its shards; seed derived from the run's seed and its
  name). ``o_c`` is the component's offset at the stage's start: the samples of its own order that
  earlier stages of the campaign consumed (the previous stage's cursor, position.py; 0 for a first
  stage, a ``data_cursor: restart`` stage, or a cursor of another order). A later stage, at other
  weights, so serves each component's next samples, and its epoch counts when it wraps.
* So the batch at position ``p`` is a pure function of ``p`` and the offsets alone - no epoch
  length, nothing from the batch layout - and data-parallel rank ``r`` takes ``[p + r*mb,
  p + (r+1)*mb)``. Resume = restore ``p`` (the offsets are the stage's, saved as its ``start`` and
  checked, never added again), under any DP size and micro-batch; skip/rollback = move ``p``.

A component that runs out either starts its next epoch, reshuffled (``exhausted="repeat"``: a
warning per new epoch, the epochs counted in ``component_stats()``) or ends the run with
``DataExhausted`` (``"stop"``). ``samples_needed_per_component`` and ``check_supply`` tell before
training whether a run of so many samples would exhaust one.

``Mixture`` is the loader's *source*, as a ShardIndex is: ShardLoader, build_loader and
build_node_loader take either. It looks like one index over all components' shards (component c's
shard i is shard ``bases[c] + i``) for the shard cache, and makes the ``MixtureOrder`` that maps
positions to those shards; window keys are ``(c, epoch of c, window)``, and a bad shard's stand-in
comes from the same component's window. Components are kept sorted by name, so the mixture (and
its order) does not depend on the order in which they are listed.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain.data.index import DataError, ShardIndex, ShardInfo
from megatrain.data.interleave import PERIOD, Interleave, quotas
from megatrain.data.loader import SampleOrder, ShardLoader
from megatrain.data.position import StreamOrder, as_cursors, continued_samples, cursor
from megatrain.errors import DeterministicError, InputError

log = logging.getLogger(__name__)

EXHAUSTED = ("repeat", "stop")


@dataclass(frozen=True)
class Component:
    """One source of a mixture: its shard version and its share of the samples (any scale)."""

    name: str
    index: ShardIndex
    weight: float


class MixtureError(DataError, InputError):
    """A mixture that cannot be served, or a loader state saved under another mixture. Deterministic."""


class DataExhausted(DeterministicError):
    """A component of an ``exhausted="stop"`` mixture was asked for more samples than it has."""

    def __init__(self, component: str, samples: int, position: int, detail: str = "") -> None:
        super().__init__(f"mixture component {component!r} is exhausted at stream position {position}: its "
                         f"{samples} samples are all served and exhausted='stop' forbids repeating them{detail}")
        self.component, self.samples, self.position = component, samples, position


def _component_seed(seed: int, name: str) -> int:
    """Each component's own shuffle seed, from the run's seed and the component's name."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little")


class Mixture:
    """Validated components, their quotas, and an index-like view over all their shards."""

    def __init__(self, components: Sequence[Component], exhausted: str = "repeat") -> None:
        if exhausted not in EXHAUSTED:
            raise ValueError(f"exhausted must be one of {EXHAUSTED}, got {exhausted!r}")
        if not components:
            raise MixtureError("a mixture needs at least one component")
        names = [c.name for c in components]
        if len(set(names)) != len(names) or not all(names):
            raise MixtureError(f"mixture component names must be unique and non-empty, got {names}")
        self.components = sorted(components, key=lambda c: c.name)
        self.exhausted = exhausted
        self.names = [c.name for c in self.components]
        for c in self.components:
            if not (c.weight > 0 and np.isfinite(c.weight)):
                raise MixtureError(f"mixture component {c.name!r}: weight must be a finite number > 0, got {c.weight}")
            if c.index.num_samples <= 0:
                raise MixtureError(f"mixture component {c.name!r} ({c.index.url}) has no samples")
        for field in ("seq_len", "dtype", "tokenizer_sha256"):
            values = {c.name: getattr(c.index, field) for c in self.components}
            if len(set(values.values())) > 1:
                raise MixtureError(f"mixture components disagree on {field}: "
                                   + ", ".join(f"{name}={value!r}" for name, value in values.items())
                                   + " (every component must be sharded with the same seq_len and tokenizer)")
        total = sum(c.weight for c in self.components)
        self.weights = [c.weight / total for c in self.components]
        self.quotas = quotas(self.weights, PERIOD)
        self.period = sum(self.quotas)
        self.sizes = [c.index.num_samples for c in self.components]

        # The index-like view: what the shard cache, the batch stream and the node loader read.
        first = self.components[0].index
        self.seq_len, self.dtype, self.np_dtype = first.seq_len, first.dtype, first.np_dtype
        self.vocab_size, self.eos_id = max(c.index.vocab_size for c in self.components), first.eos_id
        self.tokenizer_sha256 = first.tokenizer_sha256
        self.shards: list[ShardInfo] = [s for c in self.components for s in c.index.shards]
        self.bases = np.cumsum([0] + [len(c.index.shards) for c in self.components]).tolist()
        self.num_samples = sum(self.sizes)
        self.url = "mixture(" + ", ".join(f"{c.name}={c.index.url}" for c in self.components) + ")"
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        self.version = "mix-" + digest[:16]

    def identity(self) -> dict[str, Any]:
        """What fixes the order besides seed and shuffle window: components, versions, quotas.
        Weights that quantise to the same quotas are the same mixture (the order is the quotas')."""
        return {"period": self.period,
                "components": [{"name": c.name, "version": c.index.version, "quota": q}
                               for c, q in zip(self.components, self.quotas)]}

    def describe(self) -> dict[str, Any]:
        """identity() plus what a reader of a state wants to see (weights, sizes, the policy)."""
        out = self.identity()
        for entry, weight, size in zip(out["components"], self.weights, self.sizes):
            entry.update(weight=weight, samples=size)
        out["exhausted"] = self.exhausted
        return out

    def shard_url(self, i: int) -> str:
        c = bisect.bisect_right(self.bases, i) - 1
        return self.components[c].index.shard_url(i - self.bases[c])

    def stream_order(self, *, seed: int, shuffle_shards: int, start: Any = None) -> MixtureOrder:
        return MixtureOrder(self, seed, shuffle_shards, start)

    def cursor(self, c: int, seed: int, shuffle_shards: int, samples: int) -> dict[str, Any]:
        """Component ``c``'s cursor after ``samples`` of its own samples (position.py)."""
        return cursor(version=self.components[c].index.version, seed=seed, shuffle_shards=shuffle_shards,
                      mixture=True, samples=samples, epoch_len=self.sizes[c])

    def offsets(self, seed: int, shuffle_shards: int, start: Any) -> tuple[np.ndarray, list[str]]:
        """Each component's offset ``o_c`` at the stage start, from the previous stage's cursors
        ``start``, and what to say about each cursor (continued where, or why not)."""
        start = as_cursors(start)
        found = [continued_samples(start, name, self.cursor(c, seed, shuffle_shards, 0))
                 for c, name in enumerate(self.names)]
        return np.asarray([n for n, _ in found], dtype=np.int64), [note for _, note in found if note]


def _summary(identity: dict[str, Any]) -> str:
    return ", ".join(f"{c.get('name')} (version {c.get('version')}, quota {c.get('quota')}/{identity.get('period')})"
                     for c in identity.get("components", []))


class MixtureOrder(StreamOrder):
    """Stream position -> component -> its own epoch and sample -> (shard, offset)."""

    def __init__(self, mixture: Mixture, seed: int, shuffle_shards: int, start: Any = None) -> None:
        super().__init__(mixture, seed, shuffle_shards, start)
        self.mixture = mixture
        self.interleave = Interleave(mixture.quotas, seed)
        self.samples = [SampleOrder([s.num_samples for s in c.index.shards], _component_seed(seed, c.name),
                                    shuffle_shards) for c in mixture.components]
        self.sizes = np.asarray(mixture.sizes, dtype=np.int64)
        self.offsets, self.notes = mixture.offsets(seed, shuffle_shards, self.start)
        # per component, the last epoch a warning announced (those of earlier stages were announced there)
        self._epoch_logged = (self.offsets // self.sizes).tolist()

    def own_samples(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Component and its own sample number ``j = o_c + k`` of positions pos..pos+count-1."""
        comps, ks = self.interleave.take(pos, count)
        return comps, ks + self.offsets[comps]

    def pairs(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        comps, ks = self.own_samples(pos, count)
        shards, offsets = np.empty(count, np.int64), np.empty(count, np.int64)
        keys = np.empty((count, 3), np.int64)
        for c in np.unique(comps).tolist():
            where = np.flatnonzero(comps == c)  # this component's samples: k runs k0, k0+1, ...
            self._check_supply(c, ks[where], pos + where)
            epochs, idx = np.divmod(ks[where], self.sizes[c])
            for epoch in np.unique(epochs).tolist():  # a component may wrap inside one batch
                part = where[epochs == epoch]
                first = int(idx[epochs == epoch][0])
                p, w = self.samples[c].take(epoch, first, first + len(part))
                shards[part] = self.mixture.bases[c] + p[:, 0]
                offsets[part] = p[:, 1]
                keys[part] = np.stack([np.full(len(part), c), np.full(len(part), epoch), w], 1)
        return shards, offsets, keys

    def _check_supply(self, c: int, ks: np.ndarray, positions: np.ndarray) -> None:
        """Raise (``stop``) or announce (``repeat``) a component going past its samples."""
        size, name = int(self.sizes[c]), self.mixture.names[c]
        last_epoch = int(ks[-1]) // size
        if last_epoch == 0:
            return
        if self.mixture.exhausted == "stop":
            raise DataExhausted(name, size, int(positions[int(np.argmax(ks >= size))]))
        if last_epoch > self._epoch_logged[c]:  # once per new epoch (computed ahead, by the prefetcher)
            self._epoch_logged[c] = last_epoch
            log.warning("mixture component %r repeats: epoch %d of its %d samples (reshuffled) is served from "
                        "stream position %d", name, last_epoch, size,
                        self.interleave.position_of(c, last_epoch * size - int(self.offsets[c])))

    def window_shards(self, key: tuple[int, int, int]) -> np.ndarray:
        c, epoch, window = key
        return self.mixture.bases[c] + self.samples[c].windows(epoch)[0][window]

    def epoch(self, pos: int) -> int:
        return int(((self.interleave.counts(pos) + self.offsets) // self.sizes).max())

    def cursors(self, pos: int) -> dict[str, dict[str, Any]]:
        ends = self.interleave.counts(pos) + self.offsets
        return {**self.start, **{name: self.mixture.cursor(c, self.seed, self.shuffle_shards, int(ends[c]))
                                 for c, name in enumerate(self.mixture.names)}}

    def component_stats(self, pos: int) -> dict[str, dict[str, Any]]:
        counts = self.interleave.counts(pos)
        return {name: {"samples": int(n), "tokens": int(n) * (self.mixture.seq_len + 1),
                       "epochs": (int(o) + int(n)) // int(size), "start": int(o), "weight": weight}
                for name, n, o, size, weight in zip(self.mixture.names, counts, self.offsets, self.sizes,
                                                    self.mixture.weights)}

    def state_fields(self, pos: int) -> dict[str, Any]:
        return {"mixture": self.mixture.describe(), "components": self.component_stats(pos)}

    def check_state(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture")
        if saved is None:
            raise MixtureError(f"loader state is of the single shard version {state.get('version')!r}, this loader "
                               f"serves the mixture {_summary(self.mixture.identity())}; a new mixture (a new "
                               "stage) starts a new loader at position 0, without a state")
        keys = ("name", "version", "quota")
        mine = self.mixture.identity()
        if (saved.get("period") != mine["period"]
                or [[c.get(k) for k in keys] for c in saved.get("components", [])]
                != [[c[k] for k in keys] for c in mine["components"]]):
            raise MixtureError(f"loader state is of the mixture {_summary(saved)}; this loader serves "
                               f"{_summary(mine)}: another mixture means other samples at every position (a new "
                               "mixture starts a new loader at position 0, without a state)")


def build_mixture_loader(components: list[Component], *, micro_batch_size: int, dp_rank: int, dp_size: int,
                         seed: int, exhausted: str = "repeat", prefetch_batches: int = 4, on_bad_shard: str = "error",
                         verify_checksums: bool = True, shuffle_shards: int = 64, vocab_size: int | None = None,
                         rank: int | None = None, start: Any = None) -> ShardLoader:
    """The loader of data-parallel rank ``dp_rank`` over a weighted mixture: a ShardLoader (same
    interface as build_loader's) whose ``component_stats()`` reports each component's cursor.
    ``shuffle_shards`` is per component: each keeps one window of its own shards in memory.
    ``start``: the previous stage's cursors, where each component's own order continues."""
    return ShardLoader(Mixture(components, exhausted), micro_batch_size=micro_batch_size, dp_ranks=[dp_rank],
                       dp_size=dp_size, seed=seed, prefetch_batches=prefetch_batches, on_bad_shard=on_bad_shard,
                       verify_checksums=verify_checksums, shuffle_shards=shuffle_shards, vocab_size=vocab_size,
                       rank=rank, start=start)


def samples_needed_per_component(components: list[Component], total_samples: int, seed: int = 0) -> dict[str, int]:
    """Samples of each component that the first ``total_samples`` of the stream use (pass the
    loader's seed: it breaks ties of the interleave, so a count may differ by one without it)."""
    mixture = Mixture(components)
    counts = Interleave(mixture.quotas, seed).counts(total_samples)
    return {name: int(n) for name, n in zip(mixture.names, counts)}


def check_supply(components: list[Component], total_samples: int, seed: int = 0, start: Any = None,
                 shuffle_shards: int = 64) -> None:
    """Refuse, before training, a ``stop`` run of ``total_samples`` that would exhaust a component:
    DataExhausted names the first one to run out and where. ``start``: the previous stage's
    cursors (``data.cursors``; with the run's ``shuffle_shards``): what earlier stages consumed."""
    mixture = Mixture(components, "stop")
    interleave = Interleave(mixture.quotas, seed)
    offsets, _ = mixture.offsets(seed, shuffle_shards, start)
    short = [(interleave.position_of(c, max(0, size - int(o))), c, int(n), int(o))
             for c, (n, o, size) in enumerate(zip(interleave.counts(total_samples), offsets, mixture.sizes))
             if n + o > size]
    if short:
        position, c, needed, before = min(short)
        raise DataExhausted(mixture.names[c], mixture.sizes[c], position,
                            f" (a run of {total_samples} samples needs {needed} of them"
                            + (f", after the {before} that earlier stages used" if before else "") + ")")
