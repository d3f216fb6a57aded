"""Which mixture component each sample of the global stream comes from: a pure function of
(weights, seed, position), held to the weights at every prefix, in O(1) for any position.

Weights become integer quotas ``n_c`` that sum to a period ``P``: ``PERIOD`` (10,000) slots shared
by largest remainder, so each quantised weight ``n_c / P`` is within ``1/P`` (0.0001) of the asked
one; a weight below ``1/P`` still gets one slot, taken from the largest quota. Quotas are then
divided by their greatest common divisor (0.5/0.3/0.2 gives 5/3/2 over P = 10): the sequence below
is the same either way (its rule scales), only shorter.

One period is a sequence of ``P`` component numbers built by Pfair scheduling on one processor
(Baruah et al.): the k-th sample of component c (k = 1, 2, ...) may be placed from slot
``floor((k-1) P / n_c)`` on and is due by slot ``ceil(k P / n_c)``; each slot takes the released
sample due soonest, ties broken by a seeded order of the components. Every sample then lands in
its window, so at every prefix ``p`` the count of c is within one sample of ``p n_c / P``:
``|count_c(p) - p n_c / P| < 1`` (checked when the sequence is built). Against the asked weight
``w_c`` add the quantisation: ``|count_c(p) - p w_c| < 1 + p / P``; exact where the weights are
multiples of ``1/P``.

The stream repeats the period, and a prefix-count table of one period gives, for any position
(10^10 and beyond), the component ``c(p) = seq[p % P]`` and ``count_c(p) = (p // P) n_c +
prefix[c, p % P]``: no walk from position 0.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

PERIOD = 10_000  # quantisation of the weights: each is kept to 1/PERIOD


def quotas(weights: Sequence[float], period: int = PERIOD) -> tuple[int, ...]:
    """Integer quotas proportional to ``weights`` (any positive scale), reduced by their gcd."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or len(w) > period or not np.all(np.isfinite(w)) or not np.all(w > 0):
        raise ValueError(f"weights must be 1..{period} finite numbers > 0, got {list(weights)}")
    raw = w / w.sum() * period
    n = np.floor(raw).astype(np.int64)
    # Largest remainder: the slots the floors leave go to the largest fractional parts (ties: first).
    by_remainder = sorted(range(len(n)), key=lambda c: (-(raw[c] - n[c]), c))
    n[by_remainder[:period - int(n.sum())]] += 1
    while (n == 0).any():  # a weight below 1/period is still served, once per period
        n[int(np.argmax(n))] -= 1
        n[int(np.argmin(n))] += 1
    g = math.gcd(*(int(x) for x in n))
    return tuple(int(x) // g for x in n)


def _period_sequence(quota: Sequence[int], seed: int) -> np.ndarray:
    """One period: ``sum(quota)`` component numbers in Pfair earliest-deadline order."""
    period, k_max = sum(quota), len(quota)
    priority = np.random.default_rng([seed & 0xFFFFFFFF, k_max]).permutation(k_max).tolist()
    placed = [0] * k_max
    ready: list[tuple[int, int, int]] = []  # (deadline, priority, c): next samples that may be placed
    waiting: list[tuple[int, int]] = []  # (release slot, c): next samples not yet released
    for c in range(k_max):
        heapq.heappush(ready, (-(-period // quota[c]), priority[c], c))
    seq = np.empty(period, np.int64)
    for slot in range(period):
        while waiting and waiting[0][0] <= slot:
            c = heapq.heappop(waiting)[1]
            k = placed[c] + 1
            heapq.heappush(ready, (-(-k * period // quota[c]), priority[c], c))
        c = heapq.heappop(ready)[2]  # never empty: the quotas fill every slot exactly
        seq[slot] = c
        placed[c] += 1
        if placed[c] < quota[c]:
            heapq.heappush(waiting, (placed[c] * period // quota[c], c))
    return seq


class Interleave:
    """The component of every stream position and the running count of each component."""

    def __init__(self, quota: Sequence[int], seed: int) -> None:
        self.quotas = np.asarray(quota, dtype=np.int64)
        self.period = int(self.quotas.sum())
        self.seq = _period_sequence(list(quota), seed)
        k = len(self.quotas)
        onehot = np.zeros((k, self.period + 1), np.int64)
        onehot[self.seq, np.arange(1, self.period + 1)] = 1
        self.prefix = np.cumsum(onehot, axis=1)  # [c, j]: samples of c among the first j of a period
        # The promise of the module docstring, held for one period and hence for every prefix.
        lag = self.prefix * self.period - self.quotas[:, None] * np.arange(self.period + 1)
        if not (np.abs(lag) < self.period).all() or not (self.prefix[:, -1] == self.quotas).all():
            raise AssertionError(f"interleave of quotas {list(quota)} strays a sample or more from its weights")
        self._slots = [np.flatnonzero(self.seq == c) for c in range(k)]  # where c sits in a period

    def counts(self, pos: int) -> np.ndarray:
        """Samples of each component among the first ``pos`` of the stream: [components]."""
        turns, j = divmod(int(pos), self.period)
        return turns * self.quotas + self.prefix[:, j]

    def take(self, pos: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Component ``c`` and its own sample number ``k = count_c(p)`` of positions pos..pos+count-1."""
        p = np.arange(pos, pos + count, dtype=np.int64)
        turns, j = np.divmod(p, self.period)
        comps = self.seq[j]
        return comps, turns * self.quotas[comps] + self.prefix[comps, j]

    def position_of(self, c: int, k: int) -> int:
        """The stream position of component ``c``'s sample ``k`` (0-based): the inverse of take()."""
        turns, r = divmod(int(k), int(self.quotas[c]))
        return turns * self.period + int(self._slots[c][r])
