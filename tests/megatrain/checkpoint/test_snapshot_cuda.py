"""Stage 1 on a GPU: the copy runs on a side stream into pinned, reused host memory, and when
``snapshot`` returns the host copy is complete, so the next optimizer step may overwrite the
device tensors at once."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint.snapshot import RankSnapshot, Snapshotter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_snapshot_is_complete_when_it_returns(tmp_path):
    device = torch.device("cuda", 0)
    tensors = {"w": torch.randn(4096, 4096, device=device, dtype=torch.bfloat16),
               "m": torch.randn(3_000_001, device=device), "step": torch.tensor(7.0, device=device)}
    snapshotter = Snapshotter(tmp_path, device)
    for step in (1, 2):
        for t in tensors.values():
            t.add_(1)  # queued on the compute stream: the copy stream must wait for it
        expected = {k: v.cpu() for k, v in tensors.items()}
        staged = snapshotter.snapshot(RankSnapshot(step, 0, {"x.safetensors": tensors}, {}, {}))
        for t in tensors.values():
            t.mul_(0)  # "the next optimizer step", right after the snapshot returned
        written = load_file(staged.result().path / "x.safetensors")
        assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert not snapshotter.last_timing.allocated  # the second save reused the buffers
    assert snapshotter.pinned_by in ("cudaHostRegister", "pin_memory")
    snapshotter.close()
