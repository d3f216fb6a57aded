"""A compiled run restarted in its run dir skips the cold compile: the second start's ``compile`` phase
finds the first start's FX graphs and AOTAutograd entries in ``<run dir>/compile-cache``
(megatrain/launch/compile_cache.py), whatever cache folder the environment names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.observe.startup import PHASES, read_startup

ROOT = Path(__file__).resolve().parents[3]


def _train(run_dir: Path, shard_root: Path, steps: int, inherited_cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    # each start inherits another (empty) Inductor folder: only the run's own folder can hold a hit
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(inherited_cache), TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("MEGATRAIN_COMPILE_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.train", "--config", "configs/tiny-cpu.yaml", f"train.steps={steps}",
         "optim.decay_steps=2", "model.compile=true", "model.n_layer=1", "train.eval_interval=0",
         "train.tensorboard=false", "checkpoint.interval=1", "data.max_source_bytes=400000",
         f"data.shard_url={shard_root}", f"train.run_dir={run_dir}"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_startup(run_dir)


@pytest.mark.slow
def test_a_restart_in_the_run_dir_reuses_the_compiled_graphs(tmp_path, shard_root):
    run_dir = tmp_path / "run"
    cold = _train(run_dir, shard_root, 1, tmp_path / "inherited-1")
    warm = _train(run_dir, shard_root, 2, tmp_path / "inherited-2")  # resumes step 1, trains step 2

    assert list(cold["phases_s"]) == list(warm["phases_s"]) == list(PHASES)
    cache = str((run_dir / "compile-cache").resolve())
    assert cold["compile_cache"]["dir"] == warm["compile_cache"]["dir"] == cache
    assert cold["compile_cache"]["files_at_start"] == 0 and cold["compile_cache"]["fxgraph_misses"] > 0
    assert warm["compile_cache"]["files_at_start"] > 0
    assert warm["compile_cache"]["fxgraph_hits"] == cold["compile_cache"]["fxgraph_misses"]
    assert warm["compile_cache"]["fxgraph_misses"] == 0 and warm["compile_cache"]["aotautograd_hits"] > 0
    assert warm["phases_s"]["compile"] > 0 and cold["phases_s"]["compile"] > warm["phases_s"]["compile"]
    assert not any((tmp_path / name).exists() and any((tmp_path / name).iterdir())
                   for name in ("inherited-1", "inherited-2"))  # nothing went to the inherited folders
