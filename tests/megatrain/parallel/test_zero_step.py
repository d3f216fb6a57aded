"""megatrain's ZeRO-1 step (parallel/zero_step.py: copy, clip, AdamW and the bf16 weights in one pass
under a fused AdamW) against DeepSpeed's own, from one seed: one process, and two (where ZeRO-1
partitions the gradients and the optimizer state); the direct fp32 copy DeepSpeed's path keeps
for other optimizers against DeepSpeed's flatten; the gradient norm's reuse of the overflow check
(parallel/zero_norms.py) where it must not reuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tests.megatrain.parallel.conftest import ROOT

from megatrain.launch.forked import ForkLaunch, run_to_end

HERE = Path(__file__).resolve().parent


def run_worker(tmp_path: Path, nproc: int, device: str = "cpu") -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "result.pt"
    code, output = run_to_end(ForkLaunch([str(out), device], nproc, script=str(HERE / "zero_step_worker.py")), env, ROOT, 180)
    assert code == 0, output[-6000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_fast_step_trains_as_deepspeeds_own(tmp_path, nproc):
    _compare(run_worker(tmp_path, nproc))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fast_step_with_its_triton_pass_trains_as_deepspeeds_own_on_a_gpu(tmp_path):
    _compare(run_worker(tmp_path, 1, "cuda"))


def _compare(results: list[dict]) -> None:
    for result in results:
        # a checkpoint taken under megatrain's step resumes bit-exactly under it; across the two steps
        # (a checkpoint from before this change, or ds-step) the weights differ by roundings
        assert result["resume"]["megatrain->megatrain"] == 0.0
        assert result["resume"]["deepspeed->megatrain"] < 1e-3 and result["resume"]["megatrain->deepspeed"] < 1e-3
        fast, theirs = result["fast"], result["deepspeed"]
        assert fast["attached"] and fast["own_step"] and not theirs["own_step"]
        # one rank: the boundary's reduction over it is skipped, gradients stay where autograd put them
        assert fast["kept_in_place"] == (len(results) == 1) and not theirs["kept_in_place"]
        one, ref = fast["first"], theirs["first"]
        assert one["steps"] == ref["steps"] == [1.0] * len(one["steps"])
        # after one step (every step is clipped: norm ~0.8 against 0.05): the moments of the clipped
        # gradient, g / c against g * (1 / c), and the update, each a rounding or two apart
        torch.testing.assert_close(one["exp_avg"], ref["exp_avg"], rtol=1e-5, atol=1e-10)
        torch.testing.assert_close(one["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-5, atol=1e-13)
        torch.testing.assert_close(one["masters"], ref["masters"], rtol=0, atol=1e-6)
        assert (one["weights"] != ref["weights"]).float().mean() < 1e-3  # bf16: a rare rounding flip
        # three steps: bf16 weights a flip apart give gradients a little apart, and nothing more
        assert fast["last"]["steps"] == [3.0] * len(one["steps"])
        assert fast["norms"][0] == theirs["norms"][0]
        torch.testing.assert_close(torch.tensor(fast["norms"]), torch.tensor(theirs["norms"]), rtol=1e-3, atol=0)
        torch.testing.assert_close(fast["last"]["masters"], theirs["last"]["masters"], rtol=0, atol=2e-3)
        # NaN gradients: the step is skipped as DeepSpeed skips it (infinite norm, nothing updated,
        # the step count kept), and the next step trains
        for run in (fast, theirs):
            assert run["skipped"]["norm"] == float("inf") and run["skipped"]["steps"] == run["last"]["steps"]
            for key in ("masters", "exp_avg", "exp_avg_sq", "weights"):
                assert torch.equal(run["skipped"][key], run["last"][key]), key
            assert run["after"]["steps"] == [4.0] * len(run["last"]["steps"]) and run["after"]["norm"] < 10
            assert not torch.equal(run["after"]["masters"], run["last"]["masters"])

def test_the_fp32_copy_is_deepspeeds_aligned_flatten():
    from deepspeed.runtime.utils import align_dense_tensors
    from torch._utils import _flatten_dense_tensors

    from megatrain.parallel.zero_step import fp32_flat_copy

    tensors = [torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(7, dtype=torch.bfloat16),
               torch.randn(4, 2, dtype=torch.bfloat16).t()]  # a strided one too
    for alignment in (None, 8, 16):
        ours = fp32_flat_copy(tensors, alignment)
        theirs = _flatten_dense_tensors(align_dense_tensors(tensors, alignment) if alignment else tensors).float()
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_the_norm_reuses_the_overflow_checks_only_for_the_same_unchanged_tensor():
    from types import SimpleNamespace

    from megatrain.parallel.zero_norms import _cached_norms, _overflow

    grads = [torch.randn(10), torch.randn(4, 4)]
    zero = SimpleNamespace(bit16_groups=[0], averaged_gradients={0: grads}, device="cpu")
    _overflow(zero)
    fresh = lambda gs: [g.double().norm() for g in gs]  # noqa: E731
    assert all(a is b for a, b in zip(_cached_norms(zero, grads), [zero._megatrain_norms[id(g)][2] for g in grads]))
    grads[0].mul_(3)  # changed in place since the check: its norm is taken again
    torch.testing.assert_close(torch.stack(_cached_norms(zero, grads)), torch.stack(fresh(grads)))
    other = [torch.randn(10), grads[1]]  # another tensor: never the cached one's norm
    torch.testing.assert_close(torch.stack(_cached_norms(zero, other)), torch.stack(fresh(other)))
