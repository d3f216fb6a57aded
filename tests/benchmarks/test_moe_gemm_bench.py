"""benchmarks/moe_gemm.py: the FLOP count behind its TFLOP/s column, and the refusal without a GPU
(the measurement itself runs on one)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_gemm  # noqa: E402


def test_the_rate_counts_gate_and_up_of_every_routed_row():
    # moe-gpu-2b's layer: 131,072 routed rows x 1024 x 1280 x 2 FLOPs = 343.6 GFLOP; in 1 ms: 343.6 TFLOP/s
    assert moe_gemm.gemm_tflops(16384 * 8, 1024, 640, 1.0) == pytest.approx(343.597, rel=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_without_a_gpu_the_command_says_so(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        moe_gemm.main(["--out", str(tmp_path / "g.json")])


def test_a_tile_shape_that_cannot_run_is_a_row_with_its_error_not_a_stop():
    def out_of_shared_memory():
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    row = moe_gemm.fused_row("fused 256x256x128", torch.zeros(2), 3, out_of_shared_memory)
    assert row == {"name": "fused 256x256x128",
                   "error": "RuntimeError: out of resource: shared memory, Required: 262144, Hardware limit: 232448"}
