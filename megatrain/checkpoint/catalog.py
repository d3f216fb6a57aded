"""What checkpoints a durable URL holds: step directories, and which of them are committed.

A step directory is committed exactly when its ``manifest.json`` exists and parses: the manifest is
written last, through an atomic rename, after every file it lists has been uploaded and verified.
Everything else (a directory without a manifest, temporary ``.tmp`` files) is an upload that has
not finished, or never will, and is ignored by restore.

Names inside a manifest are data, not paths to trust: ``manifest_files`` confines every one to its
step directory (``storage.confined``), and a step directory that is a symlink leading out of the
durable root is not a checkpoint at all.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from megatrain import storage
from megatrain.errors import UnsafePathError
from megatrain.checkpoint.files import MANIFEST, FileRecord, parse_step


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
    Raises ValueError when a manifest exists but does not parse, is not a megatrain manifest, or
    names a file outside its step directory (UnsafePathError, a ValueError)."""
    url = storage.confined(step_url, MANIFEST, step_url)
    if not storage.exists(url):
        return None
    try:
        manifest = json.loads(storage.read_bytes(url))
    except ValueError as exc:  # bad JSON or bad UTF-8
        raise ValueError(f"{url}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "step" not in manifest:
        raise ValueError(f"{url}: not a megatrain manifest")
    manifest_files(step_url, manifest)  # every record well formed, every name confined
    return manifest


def manifest_files(step_url: str, manifest: dict[str, Any]) -> dict[str, tuple[str, FileRecord]]:
    """File name -> (its URL inside ``step_url``, its record), over all ranks (names are unique
    within a step). Raises UnsafePathError for a name that would leave the step directory and
    ValueError for a record that is not {size, sha256}."""
    source = storage.join_url(step_url, MANIFEST)
    out: dict[str, tuple[str, FileRecord]] = {}
    for rank_files in manifest["files"].values():
        if not isinstance(rank_files, dict):
            raise ValueError(f"{source}: files of a rank are not a mapping")
        for name, record in rank_files.items():
            url = storage.confined(step_url, name, source)
            try:
                out[name] = (url, FileRecord(size=int(record["size"]), sha256=str(record["sha256"])))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{source}: malformed record for {name}: {record!r}") from None
    return out


def list_checkpoints(durable_url: str) -> list[CheckpointInfo]:
    """Every step directory under ``durable_url``, oldest first (empty if the URL does not exist)."""
    if not storage.exists(durable_url):
        return []
    found = []
    for url in storage.listdir(durable_url):
        step = parse_step(posixpath.basename(url.rstrip("/")))
        if step is None:
            continue
        problem, unsafe = None, False
        try:
            url = storage.confined(durable_url, posixpath.basename(url.rstrip("/")), durable_url)  # no symlink out
            manifest = read_manifest(url)
        except UnsafePathError as exc:
            manifest, problem, unsafe = None, str(exc), True
        except ValueError as exc:
            manifest, problem = None, str(exc)
        if manifest is not None:
            records = [record for _, record in manifest_files(url, manifest).values()]
            size, files = sum(record.size for record in records), len(records)
        elif unsafe:
            size, files = 0, 0  # names leading out of the durable root: look at nothing there
        else:  # what an unfinished upload left: look at the files themselves
            present = storage.find(url)
            size, files = sum(int(d.get("size") or 0) for d in present.values()), len(present)
        found.append(CheckpointInfo(step, url, manifest, size, files, problem))
    return sorted(found, key=lambda info: info.step)


def committed(durable_url: str) -> list[CheckpointInfo]:
    """The committed checkpoints, oldest first."""
    return [info for info in list_checkpoints(durable_url) if info.committed]
