"""benchmarks/moe_permute.py: the byte floors behind its TB/s column, the refusal without a GPU,
and (in Triton's interpreter) that each new row computes what the row it replaces computed."""

import argparse
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_permute  # noqa: E402


def test_the_floors_count_each_input_once_and_each_output_once():
    # moe-gpu-2b at micro-batch 32: 65,536 tokens, top-8, d 1024. The dispatch reads x (128 MiB)
    # and writes the 524,288 rows (1 GiB); the weighted combine's backward also reads y (1 GiB)
    floors = moe_permute.floor_bytes(65536, 8, 1024, 640)
    assert floors["dispatch"] == 2 * 1024 * (65536 + 524288) == 1207959552
    assert floors["combine_bwd_weighted"] - floors["combine_bwd_plain"] == 2 * 524288 * 1024 + 8 * 524288
    assert floors["swiglu_fwd_bwd"] == 16 * 524288 * 640


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_without_a_gpu_the_command_says_so(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        moe_permute.main(["--out", str(tmp_path / "p.json")])


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
def test_each_new_pass_matches_the_one_it_replaces_in_the_interpreter():
    args = argparse.Namespace(tokens=40, top_k=3, experts=8, d=24, ff=16, iters=1, copy_tbs=4.22, sweep=True)
    rows = moe_permute.measure(args, "cpu", time_ms=lambda fn, iters: (fn(), 1.0)[1])
    compared = [row for row in rows if "max_abs_diff" in row and "kernel" not in row]
    assert len(compared) == 2 and all(row["max_abs_diff"] == 0 for row in compared), compared
    swept = [row for row in rows if "kernel" in row]  # every launch shape computes the engine's output
    from megatrain.kernels.moe_permute_triton import WARPS

    assert len(swept) == sum(len({WARPS[k], *moe_permute.SWEEP}) for k in WARPS)
    assert all(row["max_abs_diff"] < 1e-6 for row in swept)
