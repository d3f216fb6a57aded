"""megatrain's ZeRO-1 step (parallel/zero_step.py: the fp32 gradient partition copied once, the clip
inside the fused AdamW) against DeepSpeed's own, from one seed: one process, and two (where ZeRO-1
partitions the gradients and the first rank's partition takes the unaligned flatten); the
gradient norm's reuse of the overflow check (parallel/zero_norms.py) is checked where it must not
reuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from megatrain.launch.forked import ForkLaunch, run_to_end

HERE = Path(__file__).resolve().parent


def run_worker(tmp_path: Path, nproc: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "result.pt"
    code, output = run_to_end(ForkLaunch([str(out)], nproc, script=str(HERE / "zero_step_worker.py")), env, ROOT, 180)
    assert code == 0, output[-6000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_fast_step_trains_as_deepspeeds_own(tmp_path, nproc):
    for result in run_worker(tmp_path, nproc):
        fast, theirs = result["fast"], result["deepspeed"]
        assert fast["attached"]
        assert fast["norms"] == theirs["norms"]  # the same gradients every step, the norm reused exactly
        # every step clipped (norm about 0.8 against 0.05), by the fused AdamW's grad_scale
        assert all(s is not None and s > 10 for s in fast["scales"]) and theirs["scales"] == [None] * 3
        # the first moment is linear in the clipped gradient: g / c against g * (1 / c), one rounding
        torch.testing.assert_close(fast["exp_avg"], theirs["exp_avg"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(fast["masters"], theirs["masters"], rtol=0, atol=2e-5)
        torch.testing.assert_close(fast["weights"], theirs["weights"], rtol=0, atol=1e-2)


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
