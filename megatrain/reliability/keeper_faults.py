"""Faults of a node's checkpoint keeper, fired by a rank (``faults.py``): the recovery-from-memory
rows of the fault matrix.

- ``kill_keeper``: SIGKILL of the keeper of this rank's node; every copy it held is gone, as when
  the node itself is lost (with a ``kill_rank`` of the same step after it: the node's ranks and
  keeper are gone together).
- ``corrupt_keeper``: one byte flipped in each copy the keeper holds for this rank, through the
  keeper's own shared memory (a bad DIMM, a stray write); the chunk checksums then fail at restore
  and the next tier must be used.

Both first let the keeper settle, for at most ``SETTLE_S``: no copy of this rank still being
written, and, where the keeper replicates to a peer node, its newest copy sent. A test then knows
what survives the fault: the copies sealed before it, and their replicas on the other node.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import time
from pathlib import Path
from typing import Any

from megatrain.checkpoint.keeper_control import KeeperError, ask, keeper_dir

log = logging.getLogger(__name__)

SETTLE_S = 15.0


def _settled(listing: dict[str, Any], rank: int) -> bool:
    if listing.get("writing", {}).get(str(rank)):
        return False
    held = [entry["step"] for entry in listing["ranks"].get(str(rank), [])]
    peer = listing.get("peer")
    return peer is None or not held or peer["sent"].get(str(rank), {}).get("step") == max(held)


def _settle(folder: Path, rank: int) -> dict[str, Any]:
    """The keeper's listing once this rank's copies are sealed and replicated (or SETTLE_S passed)."""
    deadline = time.monotonic() + SETTLE_S
    listing = ask(folder, "list")[0]
    while not _settled(listing, rank) and time.monotonic() < deadline:
        time.sleep(0.05)
        listing = ask(folder, "list")[0]
    return listing


def _folder(staging_dir: str | Path | None, kind: str) -> Path:
    if staging_dir is None:
        raise ValueError(f"fault {kind}: the injector was built without the node's staging dir")
    return keeper_dir(staging_dir)


def kill_keeper(staging_dir: str | Path | None, rank: int) -> int | None:
    """SIGKILL the keeper of this rank's node; its pid, or None when none answers (nothing to kill)."""
    folder = _folder(staging_dir, "kill_keeper")
    try:
        listing = _settle(folder, rank)
    except KeeperError as exc:
        log.warning("fault kill_keeper: no keeper to kill (%s)", exc)
        return None
    pid = int(listing["pid"])
    held = {r: [e["step"] for e in entries] for r, entries in listing["ranks"].items()}
    os.kill(pid, signal.SIGKILL)
    log.warning("fault kill_keeper: killed the checkpoint keeper (pid %d) holding steps %s per rank", pid, held)
    return pid


def corrupt_keeper(staging_dir: str | Path | None, rank: int) -> list[int]:
    """Flip one byte in every copy this rank's keeper holds for it; returns their steps."""
    folder = _folder(staging_dir, "corrupt_keeper")
    try:
        listing = _settle(folder, rank)
    except KeeperError as exc:
        log.warning("fault corrupt_keeper: no keeper answers (%s)", exc)
        return []
    steps = [entry["step"] for entry in listing["ranks"].get(str(rank), [])]
    for step in steps:
        reply, fds = ask(folder, "get", rank=rank, step=step)
        try:
            with mmap.mmap(fds[0], reply["nbytes"]) as shared:
                shared[reply["used"] // 2] ^= 0xFF
        finally:
            os.close(fds[0])
    log.warning("fault corrupt_keeper: flipped a byte in rank %d's keeper copies of steps %s", rank, steps)
    return steps
