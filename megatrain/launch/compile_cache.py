"""Where a run's torch.compile caches live, so a restart skips the cold compile.

``torch.compile`` keeps what it compiled in Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``:
the FX graph cache, the AOTAutograd cache, the generated kernels) and Triton's
(``TRITON_CACHE_DIR``: the compiled GPU kernels). Their default is a folder under /tmp per user,
which a fresh machine or container does not have, and which other runs share. Every rank of a run
points both at one folder of the run instead:

    $MEGATRAIN_COMPILE_CACHE_DIR           when set (e.g. one folder for several campaigns)
    <campaign dir>/compile-cache           for a campaign's stage (its stages and attempts share it)
    <run dir>/compile-cache                for a plain run

so attempt 2 after a fault finds attempt 1's graphs and kernels (the first step's ``compile``
phase in ``startup.json`` counts the hits: megatrain/observe/startup.py). Dynamo still traces the
model at each start (seconds); only the lowering and kernel compilation are skipped. Keys cover
the torch version, the graph and the device, so a stale entry is never used, only missed.

Set by ``megatrain.training.rank.main`` once the config is known, before anything compiles (a
warm standby process imported Inductor earlier: its in-process caches of the folder are cleared).
Torch-free; what a cache holds is counted, never read.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_DIR_ENV = "MEGATRAIN_COMPILE_CACHE_DIR"
CACHE_DIR_NAME = "compile-cache"


def compile_cache_dir(run_dir: str | Path, environ: dict | None = None) -> Path:
    """The folder this run's compile caches go to (see the module docstring)."""
    from megatrain.config.run_dirs import is_stage_dir

    env = os.environ if environ is None else environ
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV]).resolve()
    run_dir = Path(run_dir).resolve()
    return (run_dir.parent if is_stage_dir(run_dir) else run_dir) / CACHE_DIR_NAME


def cache_env(root: Path) -> dict[str, str]:
    """The variables torch and Triton read: Inductor's and Triton's folders under ``root``."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}


def count_files(root: Path) -> int:
    """Files under ``root`` (0 when absent): how much a start found cached."""
    if not root.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(root))


def use_compile_cache(run_dir: str | Path) -> dict:
    """Point this process's compile caches at the run's folder; returns ``{"dir", "files_at_start"}``
    for the start-up breakdown."""
    root = compile_cache_dir(run_dir)
    found = count_files(root)
    os.environ.update(cache_env(root))
    root.mkdir(parents=True, exist_ok=True)
    inductor_utils = sys.modules.get("torch._inductor.utils")
    clear = getattr(inductor_utils, "clear_caches", None)
    if clear is not None:  # imported before (a warm standby): forget any folder it looked up
        clear()
    return {"dir": str(root), "files_at_start": found}
