"""Names read from metadata stay inside their folder: ``confined(base, name, source)``."""

from __future__ import annotations

import os
import re

from megatrain.errors import UnsafePathError
from megatrain.storage.urls import join_url, local_path

# A name read from metadata is one or more plain segments of ASCII letters, digits, ``.``, ``_``
# and ``-``: no ``..``, no absolute path, no backslash, drive letter, ``~``, control character or
# unicode look-alike (a fullwidth solidus or a one-dot leader is a different file to the OS, but
# not to a person reading the manifest).
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_MAX_NAME = 1024  # whole name; each segment <= 255 (NAME_MAX of every filesystem we write to)


def _name_problem(name: object) -> str | None:
    """Why ``name`` may not be used inside a folder, or None when it may."""
    if not isinstance(name, str) or not name:
        return "empty or not a string"
    if len(name) > _MAX_NAME:
        return f"{len(name)} characters long (at most {_MAX_NAME})"
    if name.startswith("/"):
        return "an absolute path"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return f"has a {segment!r} segment" if segment else "has an empty segment"
        if len(segment) > 255:
            return f"a segment of {len(segment)} characters (at most 255)"
        if not _SEGMENT.match(segment):
            odd = next(c for c in segment if not _SEGMENT.match(c))
            return f"character {odd!r} (U+{ord(odd):04X}) is not allowed (only A-Z a-z 0-9 . _ - and / between parts)"
    return None


def confined(base: str, name: object, source: str) -> str:
    """``join_url(base, name)``, refusing any ``name`` that could leave ``base``.

    Every name read from metadata (a manifest, a staged marker, a shard index) goes through here
    before anything is read or written under it. ``source`` names the metadata file the name came
    from, for the error. On a local filesystem the joined path is also resolved (symlinks
    followed) and must still lie inside ``base`` resolved: a planted symlink cannot lead out (the
    error then names the path on disk that leads out).
    Raises UnsafePathError (a deterministic error: no retry reads a different name).
    """
    problem = _name_problem(name)
    if problem is None:
        joined = join_url(base, name)
        local_base, local_joined = local_path(base), local_path(joined)
        if local_base is not None and local_joined is not None:
            root = os.path.realpath(local_base)
            real = os.path.realpath(local_joined)
            if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
                # the name may be fine: the link on disk is at fault, so the message names that path
                problem = f"on disk {local_joined} resolves (through a symlink) to {real}, outside {root}"
        if problem is None:
            return joined
    shown = repr(name) if len(repr(name)) <= 120 else repr(name)[:100] + "...(truncated)"
    raise UnsafePathError(f"unsafe name {shown} in {source}: {problem}; a name read from metadata must stay "
                          f"inside its folder {base}")


