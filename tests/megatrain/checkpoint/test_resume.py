"""Bit-exact resume through a real crash, with the real trainer as gloo ranks (forked from the warm server, as a flow's CPU ranks are).

N steps straight == N/2 steps, SIGKILL right after the N/2 checkpoint is committed, restore, N/2
more steps: the final checkpoints of both runs hold the same tensors bit for bit (model, every
rank's ZeRO partition with fp32 master weights and moments, RNG) and the same metadata (LR
schedule, loader position, DeepSpeed counters, python/numpy RNG). With 1 process and with 2 ZeRO
data-parallel processes; dropout is on so the torch RNG matters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import step_dir_name
from megatrain.checkpoint.manager import KILL_AFTER_COMMIT_ENV
from megatrain.launch.forked import CollectedRun, ForkLaunch

REPO = Path(__file__).resolve().parents[3]
STEPS, HALF = 6, 3


def _launch(nproc: int, run_dir: Path, shard_url: str, kill_after: int | None = None) -> CollectedRun:
    overrides = [
        "model.n_layer=1", "model.dropout=0.1", f"train.steps={STEPS}", f"checkpoint.interval={HALF}",
        "data.max_source_bytes=300000", f"data.shard_url={shard_url}", f"train.micro_batch_size={8 // nproc}",
        "train.log_interval=1000", f"train.run_dir={run_dir}", f"checkpoint.staging_dir={run_dir}/staging",
        f"checkpoint.durable_url={run_dir}/durable", "data.prefetch_batches=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(KILL_AFTER_COMMIT_ENV, None)
    if kill_after is not None:
        env[KILL_AFTER_COMMIT_ENV] = str(kill_after)
    return CollectedRun(ForkLaunch(["--config", "configs/tiny-cpu.yaml", *overrides], nproc), env, REPO)


def _finish(run: CollectedRun) -> tuple[int, str]:
    code, out = run.finish(300)
    assert code is not None, "timed out: " + out[-3000:]
    return code, out


def _final_state(durable: Path) -> dict:
    """Every tensor and every rank's metadata of the final checkpoint."""
    step_dir = durable / step_dir_name(STEPS)
    state = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        state.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    for path in sorted(step_dir.glob("rank-?????.json")):
        meta = json.loads(path.read_text())
        # The trainer seeds torch only, so python's and numpy's generators start from OS entropy
        # in every process and cannot match across runs (nothing in training draws from them;
        # test_checkpointer.py proves they are restored).
        meta["rng"] = {k: v for k, v in meta["rng"].items() if k not in ("python", "numpy")}
        state[path.name] = meta
    return state


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_after_commit_then_resume_is_bit_exact(tmp_path, shard_url, nproc):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    runs = [_launch(nproc, straight, shard_url), _launch(nproc, crashed, shard_url, kill_after=HALF)]  # side by side
    (code, out), (crash_code, crash_out) = _finish(runs[0]), _finish(runs[1])
    assert code == 0, out[-3000:]
    assert crash_code != 0 and "killing rank" in crash_out, crash_out[-3000:]
    assert [i.step for i in catalog.committed(str(crashed / "durable"))] == [HALF]

    code, out = _finish(_launch(nproc, crashed, shard_url))
    assert code == 0, out[-3000:]
    assert f"step {HALF})" in out  # "restored checkpoint ... (step 3)"

    expected, actual = _final_state(straight / "durable"), _final_state(crashed / "durable")
    assert expected.keys() == actual.keys()
    n_model = sum(k.startswith("model-") for k in expected)
    assert n_model > 0 and sum(k.startswith("rank-") and ".safetensors:" in k for k in expected) > 0
    different = [k for k in expected if not (torch.equal(expected[k], actual[k]) if torch.is_tensor(expected[k])
                                             else expected[k] == actual[k])]
    assert not different, f"differ after resume: {different}"
