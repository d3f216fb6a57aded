"""What checkpoints a durable URL holds: step directories, and which of them are committed.

A step directory is committed exactly when its ``manifest.json`` exists and parses: the manifest is
written last, through an atomic rename, after every file it lists has been uploaded and verified.
Everything else (a directory without a manifest, temporary ``.tmp`` files) is an upload that has
not finished, or never will, and is ignored by restore.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from megatrain import storage
from megatrain.checkpoint.files import MANIFEST, parse_step


@dataclass
class CheckpointInfo:
    step: int
    url: str
    manifest: dict[str, Any] | None  # None: not committed
    size_bytes: int  # committed: the manifest's total; otherwise what has been uploaded so far
    files: int
    problem: str | None = None  # why a manifest that exists could not be read

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def read_manifest(step_url: str) -> dict[str, Any] | None:
    """The manifest of a step directory, or None when it has none (not committed).
    Raises ValueError when a manifest exists but is not valid JSON."""
    url = storage.join_url(step_url, MANIFEST)
    if not storage.exists(url):
        return None
    try:
        manifest = json.loads(storage.read_bytes(url))
    except ValueError as exc:
        raise ValueError(f"{url}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or "files" not in manifest or "step" not in manifest:
        raise ValueError(f"{url}: not a megatrain manifest")
    return manifest


def list_checkpoints(durable_url: str) -> list[CheckpointInfo]:
    """Every step directory under ``durable_url``, oldest first (empty if the URL does not exist)."""
    if not storage.exists(durable_url):
        return []
    found = []
    for url in storage.listdir(durable_url):
        step = parse_step(posixpath.basename(url.rstrip("/")))
        if step is None:
            continue
        problem = None
        try:
            manifest = read_manifest(url)
        except ValueError as exc:
            manifest, problem = None, str(exc)
        if manifest is not None:
            size = int(manifest["bytes"])
            files = sum(len(rank_files) for rank_files in manifest["files"].values())
        else:  # what an unfinished upload left: look at the files themselves
            present = storage.find(url)
            size, files = sum(int(d.get("size") or 0) for d in present.values()), len(present)
        found.append(CheckpointInfo(step, url, manifest, size, files, problem))
    return sorted(found, key=lambda info: info.step)


def committed(durable_url: str) -> list[CheckpointInfo]:
    """The committed checkpoints, oldest first."""
    return [info for info in list_checkpoints(durable_url) if info.committed]
