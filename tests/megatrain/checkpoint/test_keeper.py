"""The checkpoint keeper with real processes: a rank process puts a snapshot and dies by SIGKILL,
the keeper still holds it; a flipped byte in its shared memory is refused; the spare-slot rule
keeps the previous copy readable; shutdown ends the keeper."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.files import ChecksumError
from megatrain.checkpoint.memory import MemoryCheckpoints, keeper_dir

PUT = textwrap.dedent("""
    import os, signal, sys, torch
    from pathlib import Path
    from megatrain.checkpoint.memory import MemoryCheckpoints
    from megatrain.checkpoint.snapshot import RankSnapshot
    staging, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    memory = MemoryCheckpoints(staging, rank=1, device=torch.device("cpu"), log_path=Path(staging) / "keeper.log")
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tensors = {"w": torch.randn(300, 70, generator=g), "n": torch.arange(5, dtype=torch.int64) + step,
                   "h": torch.randn(3, generator=g).to(torch.bfloat16), "empty": torch.empty(0)}
        timing = memory.save(RankSnapshot(step=step, rank=1, tensor_files={"rank-00001.safetensors": tensors},
                                          json_files={"rank-00001.json": {"step": step, "loader": [step, 7]}}))
        assert timing is not None
    memory.wait()  # sealed: now die the hard way, with no cleanup
    os.kill(os.getpid(), signal.SIGKILL)
""")


def expected(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 70, generator=g), "n": torch.arange(5, dtype=torch.int64) + step,
            "h": torch.randn(3, generator=g).to(torch.bfloat16), "empty": torch.empty(0)}


def put_and_die(staging: Path, steps: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PUT, str(staging), steps], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]


@pytest.mark.slow
def test_keeper_survives_the_putting_process_and_refuses_a_corrupt_copy(staging):
    put_and_die(staging, "3,4")
    memory = MemoryCheckpoints(staging, rank=1, device=torch.device("cpu"), log_path=staging / "keeper.log")
    assert memory.held_steps() == [3, 4]  # the newest and the one before (the spare slot, not yet rewritten)
    for step in (3, 4):
        files, json_files = memory.fetch(step)
        got = files["rank-00001.safetensors"]
        assert got.keys() == expected(step).keys()
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected(step).items())
        assert json_files == {"rank-00001.json": {"step": step, "loader": [step, 7]}}
    assert MemoryCheckpoints(staging, 0, torch.device("cpu"), staging / "k.log").held_steps() == []  # per rank

    # Flip one byte of step 4's shared memory, as a bad DIMM or a stray write would.
    reply, fds = memory.client().request("get", rank=1, step=4)
    with mmap.mmap(fds[0], reply["nbytes"]) as shared:
        shared[1000] ^= 0xFF
    os.close(fds[0])
    with pytest.raises(ChecksumError, match="chunk"):
        memory.fetch(4)
    assert torch.equal(memory.fetch(3)[0]["rank-00001.safetensors"]["w"], expected(3)["w"])  # the other slot is fine

    # A new save goes into the spare slot (step 3's), never over the newest (step 4's); drop forgets.
    put_and_die(staging, "5")
    assert memory.held_steps() == [4, 5]
    memory.drop_after(4)
    assert memory.held_steps() == [4]
    memory.close(shutdown=True)
    deadline = time.monotonic() + 10
    while (keeper_dir(staging) / "keeper.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (keeper_dir(staging) / "keeper.sock").exists()
    assert MemoryCheckpoints(staging, 1, torch.device("cpu"), staging / "k.log").held_steps() == []  # gone with it


def test_a_restored_slot_is_mapped_once(staging):
    """The mapping a restore reads becomes the slot's mapping: the save that later rewrites that
    slot maps nothing (unmapping an 18 GB mapping at the end of a restore cost time on the GPU)."""
    from megatrain.checkpoint.snapshot import RankSnapshot

    def save(memory: MemoryCheckpoints, step: int):
        tensors = {"w": torch.full((1000,), float(step))}
        timing = memory.save(RankSnapshot(step=step, rank=0, tensor_files={"rank-00000.safetensors": tensors},
                                          json_files={"rank-00000.json": {"step": step}}))
        memory.wait()
        return timing

    first = MemoryCheckpoints(staging, 0, torch.device("cpu"), staging / "k.log")
    assert save(first, 1).allocated and save(first, 2).allocated
    first.close()
    restarted = MemoryCheckpoints(staging, 0, torch.device("cpu"), staging / "k.log")
    files, _ = restarted.fetch(2)
    assert torch.equal(files["rank-00000.safetensors"]["w"], torch.full((1000,), 2.0))
    assert save(restarted, 3).allocated  # into step 1's slot: not mapped by this process yet
    assert not save(restarted, 4).allocated  # into step 2's slot: mapped by the restore
    restarted.close(shutdown=True)


def test_an_entry_outside_the_copy_is_refused_not_a_crash():
    """A keeper record whose offset points past the copy (records are not under the checksums) is a
    ValueError, which read_newest turns into 'use the next tier'; a view past the end was a
    RuntimeError that crashed every restart the same way."""
    from megatrain.checkpoint.memory import _view

    buffer = torch.zeros(64, dtype=torch.uint8)
    assert _view(buffer, ["f", "w", "torch.float32", [4], 48]).shape == (4,)
    for offset in (52, 64, -4):
        with pytest.raises(ValueError, match="outside the copy"):
            _view(buffer, ["f", "w", "torch.float32", [4], offset])
