"""Which documents a shard version holds out for validation, so that every component has some.

Two rules, applied to each shard version (a mixture's component is a version of its own):

1. **The fraction.** A document is held out when a hash of its text falls in the first
   ``data.val_fraction`` of the hash range: the same text is on the same side in every run and
   file order, and a duplicate never lands on both sides.
2. **The floor.** A version whose rule-1 documents make less than one window (``seq_len + 1``
   tokens, the least a loss can be computed on) also holds out its documents of *smallest hash*,
   in hash order, until they make one, as long as one window is left to train on. A version too
   small for that (a one-document component, say) has no validation split, and says why in one
   line (``ShardIndex.val_note``), which the trainer logs and ``megatrain status`` shows. A
   34-document component at ``val_fraction`` 0.01 no longer gets nothing, silently.

The floor is a function of the version's documents, not of how they were cut into work units.
Every unit holds back from its training shards a *reserve*: its not-held-out documents of
smallest hash, just enough of them for one window (``Reserve``). ``finish_sharding``, which sees
every unit, takes documents in hash order from the union of the reserves (``choose_floor``); the
rest go back to training, in the version's tail shards. The union holds the version's smallest
hashes: a document outside its unit's reserve has a larger hash than a whole window of that
unit's documents, more than the floor can ever take. Documents of equal hash (duplicates) are
taken or left together, in a unit's reserve and at the finish.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

FLOOR = "one window"  # in a version's params: its held-out split follows rule 2 as well as rule 1


def document_hash(document: str) -> int:
    """The 64-bit hash both rules read (big-endian, the first 8 bytes of the text's sha256)."""
    return int.from_bytes(hashlib.sha256(document.encode()).digest()[:8], "big")


def is_held_out(document: str, val_fraction: float) -> bool:
    """Rule 1: the document's hash falls in the first ``val_fraction`` of the hash range."""
    if val_fraction <= 0:
        return False
    return document_hash(document) < val_fraction * 2**64


class Reserve:
    """A unit's documents of smallest hash, at least ``window`` tokens of them (all, if it has fewer).

    ``offer`` takes every document not held out by rule 1 and returns those that leave the reserve
    (for the unit's training shards, in that order): the whole group of the largest hash whenever
    the rest still make a window. Memory: one window of tokens plus one document."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: list[tuple[int, int]] = []  # (hash, arrival), sorted
        self.ids: dict[tuple[int, int], list[int]] = {}
        self.tokens = 0
        self._arrivals = 0

    def offer(self, digest: int, ids: list[int]) -> list[list[int]]:
        if self.tokens >= self.window and digest > self.keys[-1][0]:
            return [ids]  # larger than every kept hash while the reserve is full: it trains
        key = (digest, self._arrivals)
        self._arrivals += 1
        bisect.insort(self.keys, key)
        self.ids[key] = ids
        self.tokens += len(ids)
        out = []
        while self.keys:
            largest = self.keys[-1][0]
            group = self.keys[bisect.bisect_left(self.keys, (largest, -1)):]
            group_tokens = sum(len(self.ids[k]) for k in group)
            if self.tokens - group_tokens < self.window:
                break
            del self.keys[-len(group):]
            out += [self.ids.pop(k) for k in group]
            self.tokens -= group_tokens
        return out

    def documents(self) -> list[tuple[int, list[int]]]:
        """The reserve as (hash, token ids), in hash order."""
        return [(k[0], self.ids[k]) for k in self.keys]


@dataclass(frozen=True)
class ReservedDocument:
    unit: int  # which unit's reserve holds it
    position: int  # its place in that reserve (hash order)
    digest: int
    tokens: int


@dataclass(frozen=True)
class FloorChoice:
    taken: frozenset[tuple[int, int]]  # (unit, position) of the reserved documents held out by rule 2
    documents: int  # the version's held-out documents, both rules
    note: str  # one line when rule 2 acted, or why the version has no validation split; else ""
    split: bool = True  # False: no validation split, and rule 1's few documents train instead


def choose_floor(reserved: list[ReservedDocument], held_documents: int, held_tokens: int, train_tokens: int,
                 total_documents: int, window: int, val_fraction: float) -> FloorChoice:
    """Rule 2 over a version: ``reserved`` are the documents of every unit's reserve;
    ``held_documents`` / ``held_tokens`` what rule 1 held out; ``train_tokens`` every token that
    trains if nothing more is held out (the reserves included)."""
    if held_tokens >= window:
        return FloorChoice(frozenset(), held_documents, "")
    need = window - held_tokens
    ordered = sorted(reserved, key=lambda d: (d.digest, d.unit, d.position))
    taken, tokens, i = [], 0, 0
    while tokens < need and i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j].digest == ordered[i].digest:  # duplicates go together
            j += 1
        taken += ordered[i:j]
        tokens += sum(d.tokens for d in ordered[i:j])
        i = j
    documents = held_documents + len(taken)
    fraction = f"data.val_fraction {val_fraction:g} held out {held_documents} of its {total_documents} documents"
    if tokens >= need and train_tokens - tokens >= window:
        return FloorChoice(frozenset((d.unit, d.position) for d in taken), documents,
                           f"{fraction}, fewer than one window of {window} tokens; {len(taken)} more (those of "
                           f"smallest hash) are held out to fill one")
    plural = "" if total_documents == 1 else "s"
    returned = f" (the {held_documents} that data.val_fraction held out train instead)" if held_documents else ""
    return FloorChoice(frozenset(), 0, f"no validation split: {total_documents} document{plural} of "
                       f"{held_tokens + train_tokens} tokens in all cannot give one held-out window of {window} "
                       f"tokens and keep one to train on{returned}", split=False)
