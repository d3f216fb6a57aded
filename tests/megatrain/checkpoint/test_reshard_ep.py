"""Checkpoints of expert-parallel runs (checkpoint/experts.py), with the real trainer under torchrun.

A tiny MoE (moe-tiny-cpu shrunk: 4 experts, d_model 64) trains 6 steps at EP2 on 2 gloo ranks,
saving at steps 3 and 6. Copies of its step-3 checkpoint resume:

- at EP2: steps 4-6 and the step-6 checkpoint (weights, moments) equal the uninterrupted run's bit
  for bit, and the samples consumed are the stream's positions 24-47 in order;
- at EP1, one process (resharded: the experts' slices and their moments joined): the same samples,
  losses and grad norms of steps 4-6 within 1e-5 of the EP2 run, and the step-6 weights, fp32
  masters and moments within 1e-5.

The helpers (launch, metrics, recorded samples, full state) are test_reshard.py's.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_reshard import GLOBAL_BATCH, SAVE_STEP, STEPS, TOL, _full, _metrics, _samples, _train, _worst
from test_reshard import shards  # noqa: F401  (the fixture: shards and the stream's sample order)

from megatrain.checkpoint.files import model_file, step_dir_name

pytestmark = pytest.mark.slow  # torchrun ranks

CONFIG = "configs/moe-tiny-cpu.yaml"
N_EXPERTS = 4
MOE = ("model.d_model=64", f"model.moe.n_experts={N_EXPERTS}", "model.moe.expert_d_ff=32",
       "parallel.zero_stage=0", "train.dtype=fp32")  # what expert parallelism composes with
# The MoE penalties (load balance, z-loss) are per micro-batch: EP1 takes EP2's micro-batches one
# after another (accumulation 2), so each penalty sees the same tokens
MICRO = f"train.micro_batch_size={GLOBAL_BATCH // 2}"
EP2 = (*MOE, "parallel.ep=2", MICRO)


@pytest.fixture(scope="module")
def ep2_straight(shards, tmp_path_factory) -> Path:  # noqa: F811
    """The uninterrupted EP2 run (its step-3 checkpoint is what the others resume)."""
    run_dir = tmp_path_factory.mktemp("ep") / "ep2-straight"
    _train(run_dir, shards[0], 2, STEPS, *EP2, config=CONFIG)
    return run_dir


def _resume(tmp_path: Path, url: str, straight: Path, name: str, nproc: int, *overrides: str) -> Path:
    run_dir = tmp_path / name
    step = step_dir_name(SAVE_STEP)
    shutil.copytree(straight / "durable" / step, run_dir / "durable" / step)
    _train(run_dir, url, nproc, STEPS, *overrides, config=CONFIG)
    assert sorted(_metrics(run_dir)) == list(range(SAVE_STEP + 1, STEPS + 1)), f"{name}: did not resume at step 3"
    return run_dir


def _check_samples(run_dir: Path, order: list[str]) -> None:
    """The resumed run consumed exactly the stream's samples after the checkpoint, in order."""
    samples = _samples(run_dir)
    assert [p for p, _, _ in samples] == list(range(SAVE_STEP * GLOBAL_BATCH, STEPS * GLOBAL_BATCH))
    assert [h for _, _, h in samples] == order[SAVE_STEP * GLOBAL_BATCH:STEPS * GLOBAL_BATCH]


def _header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return {k: v for k, v in json.loads(handle.read(length)).items() if k != "__metadata__"}


def test_ep2_writes_every_expert_once_and_resumes_bit_exact(tmp_path, shards, ep2_straight):  # noqa: F811
    step_dir = ep2_straight / "durable" / step_dir_name(SAVE_STEP)
    dense, slices = _header(step_dir / model_file(0, 0)), [_header(step_dir / model_file(0, 0, e)) for e in (0, 1)]
    assert dense and not any(".experts." in name for name in dense), "the replicated file holds no routed expert"
    assert slices[0].keys() == slices[1].keys() and all(".experts." in name for name in slices[0])
    for name in slices[0]:  # each EP rank's file holds its half of the layer's experts: all of them once
        assert sum(s[name]["shape"][0] for s in slices) == N_EXPERTS, name

    resumed = _resume(tmp_path, shards[0], ep2_straight, "ep2-resumed", 2, *EP2)
    assert "resharded" not in (resumed / "train.log").read_text(), "same layout: read directly"
    got, want = _metrics(resumed), _metrics(ep2_straight)
    for step in got:
        assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), step
    assert _worst(_full(resumed, STEPS), _full(ep2_straight, STEPS)) == 0.0
    _check_samples(resumed, shards[1])


def test_ep2_reshards_into_one_process(tmp_path, shards, ep2_straight):  # noqa: F811
    ep1 = _resume(tmp_path, shards[0], ep2_straight, "ep1", 1, *MOE, MICRO)
    assert "resharded into dp=1 tp=1 pp=1 ep=1" in (ep1 / "train.log").read_text()
    _check_samples(ep1, shards[1])
    got, want = _metrics(ep1), _metrics(ep2_straight)
    loss = max(abs(got[s]["loss"] - want[s]["loss"]) for s in got)
    # DeepSpeed reports no global grad norm without ZeRO and EP (0.0): EP1's steps are checked
    # through the weights and moments
    grad = max([abs(got[s]["grad_norm"] - want[s]["grad_norm"]) for s in got if got[s]["grad_norm"]], default=0.0)
    state = _worst(_full(ep1, STEPS), _full(ep2_straight, STEPS))  # all experts, joined from the EP2 slices
    print(f"\nEP2 -> EP1 at step {SAVE_STEP}, steps 4-6 vs EP2 straight: |loss| {loss:.1e} |grad norm| {grad:.1e} "
          f"|weights, masters, moments| {state:.1e}")
    assert max(loss, grad, state) <= TOL
