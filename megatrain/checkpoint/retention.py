"""Which checkpoints to keep, and cleaning up staged steps once they are durable.

Rules: keep the newest ``keep_last`` committed checkpoints and every committed step divisible by
``keep_every``; never delete the newest committed one; never touch a step that is not committed
(it may be an upload still in flight). A deletion removes ``manifest.json`` first, so a
checkpoint half-way through deletion is already "not committed" and restore skips it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from megatrain import storage
from megatrain.errors import UnsafePathError
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import MANIFEST, parse_step, step_dir_name

log = logging.getLogger("megatrain.checkpoint")


def steps_to_delete(committed_steps: list[int], keep_last: int, keep_every: int | None = None) -> list[int]:
    """The committed steps the rules let go, oldest first."""
    steps = sorted(set(committed_steps))
    keep = set(steps[-max(keep_last, 1):])  # max(.., 1): the newest always survives
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def apply_retention(durable_url: str, keep_last: int, keep_every: int | None = None) -> list[int]:
    """Delete the committed checkpoints the rules let go; returns their steps."""
    infos = {info.step: info for info in catalog.committed(durable_url)}
    deleted = []
    for step in steps_to_delete(list(infos), keep_last, keep_every):
        url = infos[step].url
        try:
            storage.rm(storage.join_url(url, MANIFEST))  # un-commit first
            storage.rm(url, recursive=True)
            deleted.append(step)
        except OSError as exc:
            log.warning("retention: could not delete %s: %s", url, exc)
    if deleted:
        log.info("retention: deleted checkpoints of steps %s", deleted)
    return deleted


def clean_staging(staging_dir: str | Path, durable_url: str) -> list[int]:
    """Remove staged step dirs whose durable copy is committed; returns their steps. Storage
    errors leave a staged dir in place (it is cleaned at a later call)."""
    root = Path(staging_dir)
    if not root.is_dir():
        return []
    cleaned = []
    for path in sorted(root.iterdir()):
        step = parse_step(path.name)
        if step is None:
            continue
        try:
            storage.confined(str(root), path.name, str(root))  # a symlinked step dir is not ours to delete
        except UnsafePathError as exc:
            log.warning("retention: leaving %s alone: %s", path, exc)
            continue
        try:
            done = storage.exists(storage.join_url(durable_url, step_dir_name(step), MANIFEST))
        except OSError:
            continue
        if done:
            shutil.rmtree(path, ignore_errors=True)  # ranks sharing a staging dir may race here
            cleaned.append(step)
    return cleaned
