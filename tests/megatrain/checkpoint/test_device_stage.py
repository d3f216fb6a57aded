"""A keeper copy staged on the GPU (device_stage.py): the device bytes equal the host bytes for
sizes that are not a multiple of the chunk, and a keeper restore on CUDA gives device views for
large tensors and host views for small ones (the CPU generator's state must stay a host tensor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.device_stage import CHUNK, fits_on_device, stage_on_device
from megatrain.checkpoint.memory import SMALL, MemoryCheckpoints
from megatrain.checkpoint.snapshot import RankSnapshot



def test_a_cpu_restore_keeps_the_host_path():
    assert not fits_on_device(10, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nbytes", [1, CHUNK - 3, 5 * CHUNK + 17])
@pytest.mark.parametrize("threads", [1, 3])
def test_staged_bytes_equal_the_host_bytes(nbytes, threads):
    host = torch.randint(0, 256, (nbytes + 100,), dtype=torch.uint8)
    staged = stage_on_device(host, nbytes, torch.device("cuda", 0), threads=threads)
    assert staged.shape == (nbytes,) and staged.is_cuda
    assert torch.equal(staged.cpu(), host[:nbytes])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_restore_reads_large_tensors_from_the_device(staging: Path):
    device = torch.device("cuda", 0)
    memory = MemoryCheckpoints(staging, rank=0, device=device, log_path=staging / "keeper.log")
    tensors = {"w": torch.randn(3000, 700, device=device), "rng": torch.arange(5, dtype=torch.uint8),
               "h": torch.randn(1 << 20, device=device).to(torch.bfloat16)}
    assert memory.save(RankSnapshot(step=4, rank=0, tensor_files={"rank-00000.safetensors": tensors},
                                    json_files={"rank-00000.json": {"step": 4}})) is not None
    memory.wait()
    files, json_files = memory.fetch(4)
    read = files["rank-00000.safetensors"]
    assert json_files["rank-00000.json"] == {"step": 4}
    for name, tensor in tensors.items():
        large = tensor.numel() * tensor.element_size() >= SMALL
        assert read[name].is_cuda == large, name
        assert torch.equal(read[name].cpu(), tensor.cpu()), name
    memory.close(shutdown=True)
