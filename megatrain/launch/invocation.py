"""How to type this project's commands from here: the interpreter and console scripts of the
environment that is running, as a hint or a resume line should name them.

A hint that says ``python -m flows.pretrain`` or ``megatrain train`` runs another Python, or
none, in a shell whose PATH lacks the project's virtual environment (``make demo`` runs
``.venv/bin/python`` without activating it). These name the running interpreter instead,
relative to the working directory when it lies below it (``.venv/bin/python``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def _as_typed(path: Path) -> str:
    try:
        relative = path.relative_to(Path.cwd())
    except ValueError:
        return str(path)
    return str(relative) if relative.parts and relative.parts[0].startswith(".") else f"./{relative}"


def python_command() -> str:
    """The running interpreter as a user types it here (``.venv/bin/python``)."""
    return _as_typed(Path(sys.executable).absolute())


def script_command(name: str) -> str:
    """A console script of the running environment (``megatrain``, ``torchrun``): the bare name
    when PATH finds that very script, else its path beside the interpreter; the bare name when
    the environment has none."""
    beside = Path(sys.executable).absolute().parent / name
    if not beside.exists():
        return name
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(beside):
        return name
    return _as_typed(beside)
