"""The join barrier every rank passes before any communicator exists, and a store wrapper that
counts (and can record) the operations a start-up sends to the rendezvous store.

The join barrier is what makes start-up faults clear instead of silent hangs:

- each rank claims its rank number with ``compare_set(join/rank<r>, "", <host:pid:nonce>)``: a
  second process claiming the same rank (a rank joining twice) gets the first one's identity
  back and fails with ``RankJoinedTwice`` naming both;
- each rank adds 1 to one counter, the last sets ``join/done`` and everyone waits for it - O(1)
  operations per rank, O(n) in all, no rank reads the others' keys;
- when ``join/done`` does not appear in time, the ranks that never claimed their number are
  listed (``RendezvousTimeout``): the only O(n) read, and only on failure.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

import torch.distributed as dist

from megatrain.waits import bounded, waiting


class RendezvousTimeout(RuntimeError):
    """Some ranks never joined the rendezvous (a retry may succeed: a node can come back)."""


class RankJoinedTwice(RuntimeError):
    """Two processes claimed the same rank in one rendezvous."""


def join(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Check in as ``rank`` and wait until all ``world_size`` ranks have; see the module doc."""
    me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}".encode()
    owner = bytes(store.compare_set(f"join/rank{rank}", b"", me))
    if owner != me:
        raise RankJoinedTwice(f"rank {rank} joined twice: already claimed by {owner.decode(errors='replace')} "
                              f"(this process is {me.decode()}); two launches share one rendezvous")
    if store.add("join/count", 1) == world_size:
        store.set("join/done", b"1")
    try:
        store.wait(["join/done"], timedelta(seconds=timeout_s))
    except (dist.DistStoreError, RuntimeError) as exc:
        if type(exc).__name__ == "StoreLost":  # the store restarted: the caller starts over
            raise
        try:
            missing = [r for r in range(world_size) if not store.check([f"join/rank{r}"])]
        except (dist.DistError, RuntimeError) as gone:  # the store's host (rank 0 on TCPStore) gave up first
            raise RendezvousTimeout(f"rendezvous timed out after {timeout_s:.0f} s, and the store went away "
                                    f"before the missing ranks could be listed: {gone}") from exc
        raise RendezvousTimeout(
            f"rendezvous timed out after {timeout_s:.0f} s: {len(missing)} of {world_size} ranks never joined: "
            f"{_ranges(missing)}"
        ) from exc


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5" (a missing node is a run of ranks)."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts) or "none"


class CountingStore(dist.Store):
    """Forwards every call to ``inner`` and counts it by kind; with ``record=True`` also keeps
    the ordered (op, key) trace (benchmarks/init.py replays it at scale). c10d calls a Python
    store under the GIL: fine for start-up traffic.

    Every call is a wait on the process that serves the store (``megatrain/waits.py``): it shows
    in the heartbeat, and it ends by ``deadline_s`` (the store's timeout plus a grace; a ``wait``
    by its own timeout plus the grace) with one line naming the store at ``where``, even where
    c10d's own timeout does not hold (a TCPStore server that stopped answering)."""

    GRACE_S = 5.0

    def __init__(self, inner: dist.Store, record: bool = False, where: str = "the rendezvous store",
                 deadline_s: float = 600.0) -> None:
        super().__init__()
        self.inner, self.where, self.deadline_s = inner, where, deadline_s
        self.ops: dict[str, int] = {}
        self.trace: list[tuple[str, str]] | None = [] if record else None

    def _call(self, op: str, key: str, call, deadline_s: float | None = None):
        self.ops[op] = self.ops.get(op, 0) + 1
        if self.trace is not None:
            self.trace.append((op, key))
        limit = (deadline_s if deadline_s is not None else self.deadline_s) + self.GRACE_S
        with waiting(f"rendezvous store: {op} {key}", self.where, limit) as wait:
            return bounded(call, wait, "the store's server accepted the call and did not answer")

    def set(self, key, value):
        self._call("set", key, lambda: self.inner.set(key, value))

    def get(self, key):
        return self._call("get", key, lambda: self.inner.get(key))

    def add(self, key, amount):
        return self._call("add", key, lambda: self.inner.add(key, amount))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, lambda: self.inner.compare_set(key, expected, desired))

    def wait(self, keys, timeout=None):
        if timeout is None:
            return self._call("wait", ",".join(keys), lambda: self.inner.wait(keys))
        return self._call("wait", ",".join(keys), lambda: self.inner.wait(keys, timeout), timeout.total_seconds())

    def check(self, keys):
        return self._call("check", ",".join(keys), lambda: self.inner.check(keys))

    def delete_key(self, key):
        return self._call("delete_key", key, lambda: self.inner.delete_key(key))

    def num_keys(self):
        return self._call("num_keys", "", self.inner.num_keys)

    def set_timeout(self, timeout):
        self.deadline_s = timeout.total_seconds()
        self.inner.set_timeout(timeout)
