"""Checkpoints of expert-parallel runs (checkpoint/experts.py), with the real trainer under torchrun.

A tiny MoE (moe-tiny-cpu shrunk: 4 experts, d_model 64) trains 9 steps at EP2 on 2 gloo ranks,
saving at steps 3, 6 and 9. Copies of its checkpoints resume:

- at EP2 from step 3: steps 4-9 and the step-9 checkpoint (weights, moments) equal the
  uninterrupted run's bit for bit;
- at EP1, one process, from step 3 (resharded: the experts' slices and their moments joined), to
  step 6; and from that EP1 checkpoint at EP2 again (resharded: cut) to step 9. Losses (and EP2's
  grad norms) within 1e-5 of the uninterrupted run, and the weights, fp32 masters and moments of
  steps 6 and 9 within 1e-5.

The whole model that export, eval and generate read (interop) is the EP slices joined. Every
resumed run consumes exactly the uninterrupted run's samples after its checkpoint (stream position
and tokens). The helpers (launch, metrics, recorded samples, full state) are test_reshard.py's.
The pure pieces (which rank writes which file, join and cut) are checked in one process below.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from test_reshard import GLOBAL_BATCH, TOL, _full, _metrics, _samples, _train, _worst
from test_reshard import shards  # noqa: F401  (the fixture: shards and the stream's sample order)

from megatrain.checkpoint import experts
from megatrain.checkpoint.files import model_file, step_dir_name
from megatrain.interop.checkpoint import full_state_dict, read_run_config
from megatrain.model import GPT
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.expert_parallel import EXPERT_PARAM, EXPERT_SLICE

CONFIG = "configs/moe-tiny-cpu.yaml"
N_EXPERTS, STEPS = 4, 9  # checkpoints every 3 steps (test_reshard's interval)
MOE = ("model.d_model=64", f"model.moe.n_experts={N_EXPERTS}", "model.moe.expert_d_ff=32",
       "parallel.zero_stage=0", "train.dtype=fp32")  # what expert parallelism composes with
# The MoE penalties (load balance, z-loss) are per micro-batch: EP1 takes EP2's micro-batches one
# after another (accumulation 2), so each penalty sees the same tokens
MICRO = f"train.micro_batch_size={GLOBAL_BATCH // 2}"
EP2 = (*MOE, "parallel.ep=2", MICRO)
EP1 = (*MOE, MICRO)


@pytest.fixture(scope="module")
def ep2_straight(shards, tmp_path_factory) -> Path:  # noqa: F811
    """The uninterrupted EP2 run, whose samples are the stream's (the others resume its checkpoints)."""
    run_dir = tmp_path_factory.mktemp("ep") / "ep2-straight"
    _train(run_dir, shards[0], 2, STEPS, *EP2, config=CONFIG)
    head = _samples(run_dir)[:len(shards[1])]
    assert [(p, h) for p, _, h in head] == list(enumerate(shards[1]))
    return run_dir


def _resume(tmp_path: Path, url: str, source: Path, step: int, name: str, nproc: int, until: int,
            *overrides: str) -> Path:
    """A run that starts from a copy of ``source``'s checkpoint of ``step`` and trains to ``until``."""
    run_dir = tmp_path / name
    shutil.copytree(source / "durable" / step_dir_name(step), run_dir / "durable" / step_dir_name(step))
    _train(run_dir, url, nproc, until, *overrides, config=CONFIG)
    assert sorted(_metrics(run_dir)) == list(range(step + 1, until + 1)), f"{name}: did not resume at step {step}"
    return run_dir


def _check_samples(run_dir: Path, straight: Path) -> None:
    """The resumed run consumed exactly the uninterrupted run's samples after its checkpoint."""
    got = [(p, h) for p, _, h in _samples(run_dir)]
    first = got[0][0]
    assert first % GLOBAL_BATCH == 0 and [p for p, _ in got] == list(range(first, first + len(got)))
    assert got == [(p, h) for p, _, h in _samples(straight)][first:first + len(got)]


def _header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return {k: v for k, v in json.loads(handle.read(length)).items() if k != "__metadata__"}


def _differences(run_dir: Path, straight: Path, step: int) -> tuple[float, float, float]:
    """|loss|, |grad norm| (where the run reports one: DeepSpeed does not without ZeRO and EP) and
    |weights, masters, moments| of ``step``'s checkpoint against the uninterrupted run."""
    got, want = _metrics(run_dir), _metrics(straight)
    loss = max(abs(got[s]["loss"] - want[s]["loss"]) for s in got)
    grad = max([abs(got[s]["grad_norm"] - want[s]["grad_norm"]) for s in got if got[s]["grad_norm"]], default=0.0)
    return loss, grad, _worst(_full(run_dir, step), _full(straight, step))


@pytest.mark.slow
def test_ep2_writes_every_expert_once_and_resumes_bit_exact(tmp_path, shards, ep2_straight):  # noqa: F811
    step_dir = ep2_straight / "durable" / step_dir_name(3)
    dense, slices = _header(step_dir / model_file(0, 0)), [_header(step_dir / model_file(0, 0, e)) for e in (0, 1)]
    assert dense and not any(".experts." in name for name in dense), "the replicated file holds no routed expert"
    assert slices[0].keys() == slices[1].keys() and all(".experts." in name for name in slices[0])
    for name in slices[0]:  # each EP rank's file holds its half of the layer's experts: all of them once
        assert sum(s[name]["shape"][0] for s in slices) == N_EXPERTS, name
    # export, eval and generate read the whole model (interop/checkpoint.py): the slices in EP order
    manifest = json.loads((step_dir / "manifest.json").read_text())
    whole = full_state_dict(str(step_dir), manifest, GPT(read_run_config(str(ep2_straight)).model))
    joined = _full(ep2_straight, 3).params
    assert whole.keys() == joined.keys() and all(torch.equal(whole[n], joined[n].weight) for n in whole)

    resumed = _resume(tmp_path, shards[0], ep2_straight, 3, "ep2-resumed", 2, STEPS, *EP2)
    assert "resharded" not in (resumed / "train.log").read_text(), "same layout: read directly"
    got, want = _metrics(resumed), _metrics(ep2_straight)
    for step in got:
        assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), step
    assert _worst(_full(resumed, STEPS), _full(ep2_straight, STEPS)) == 0.0
    _check_samples(resumed, ep2_straight)


@pytest.mark.slow
def test_ep2_reshards_into_one_process_and_back(tmp_path, shards, ep2_straight):  # noqa: F811
    ep1 = _resume(tmp_path, shards[0], ep2_straight, 3, "ep1", 1, 6, *EP1)
    assert "resharded into dp=1 tp=1 pp=1 ep=1" in (ep1 / "train.log").read_text()
    back = _resume(tmp_path, shards[0], ep1, 6, "ep2-again", 2, STEPS, *EP2)
    assert "resharded into dp=2 tp=1 pp=1 ep=2" in (back / "train.log").read_text()
    rows = []
    for name, run_dir, step in (("EP2 -> EP1 at step 3", ep1, 6), ("EP1 -> EP2 at step 6", back, STEPS)):
        _check_samples(run_dir, ep2_straight)
        loss, grad, state = _differences(run_dir, ep2_straight, step)
        rows.append(f"{name}, to step {step}: |loss| {loss:.1e} |grad norm| {grad:.1e} "
                    f"|weights, masters, moments| {state:.1e}")
        assert max(loss, grad, state) <= TOL, rows[-1]
    print("\nvs EP2 straight:\n" + "\n".join(rows))


# ---- the pieces, in one process ------------------------------------------------------------------


def _groups(dp: int, ep: int, rank: int) -> ProcessGroups:
    return ProcessGroups(dims=ParallelDims(dp=dp, tp=1, pp=1, ep=ep), rank=rank)


def test_each_expert_slice_has_one_writer():
    """dp4 x ep2: dp_rank 0 writes the replicated weights and EP rank 0's experts, dp_rank 1 EP rank
    1's; dp_ranks 2 and 3 (same experts as 0 and 1) write none. Without EP: dp_rank 0, one file."""
    written = [experts.weight_files(_groups(4, 2, r)) for r in range(4)]
    assert written == [[model_file(0, 0), model_file(0, 0, 0)], [model_file(0, 0, 1)], [], []]
    assert [experts.weight_files(_groups(2, 1, r)) for r in range(2)] == [[model_file(0, 0)], []]
    merged = experts.read_weights(_groups(4, 2, 0), lambda name: {name: torch.zeros(1)})
    assert sorted(merged) == sorted(written[0]) and experts.read_weights(_groups(4, 2, 3), dict) is None


def test_slices_cut_from_the_joined_experts_are_the_ranks_own():
    full = torch.arange(N_EXPERTS * 6, dtype=torch.float32).reshape(N_EXPERTS, 2, 3)
    for ep in (1, 2, 4):
        local = N_EXPERTS // ep
        shards = []
        for e in range(ep):
            shard = torch.nn.Parameter(full[e * local:(e + 1) * local].clone())
            if ep > 1:
                setattr(shard, EXPERT_PARAM, True)
                setattr(shard, EXPERT_SLICE, (e * local, N_EXPERTS))
            shards.append(shard)
        assert torch.equal(experts.join([s.detach() for s in shards]), full)
        for shard in shards:
            assert torch.equal(experts.cut(shard, full, "fc"), shard.detach())
    with pytest.raises(ValueError, match="fc: the checkpoint holds 2 experts, this run's layer 4"):
        experts.cut(shards[0], full[:2], "fc")


@pytest.mark.slow
def test_ep2_restores_at_cp2_times_ep2(tmp_path, shards, ep2_straight):  # noqa: F811
    """EP2 over 2 data-parallel ranks -> EP2 over one sample's 2 context-parallel ranks (dp 1): the
    EP group is now the cp group (dims.py), each rank routes the tokens of its chunks, the balance
    loss counts the whole micro-batch's slots. Steps 4-6 equal the uninterrupted run within 1e-5."""
    cp = _resume(tmp_path, shards[0], ep2_straight, 3, "cp2-ep2", 2, 6, *EP2, "parallel.cp=2")
    _check_samples(cp, ep2_straight)
    loss, grad, state = _differences(cp, ep2_straight, 6)
    print(f"\nEP2 -> cp2 x EP2 at step 3, to step 6: |loss| {loss:.1e} |grad norm| {grad:.1e} "
          f"|weights, masters, moments| {state:.1e}")
    assert max(loss, grad, state) <= TOL
