"""benchmarks/grouped_gemm_skew.py needs CUTLASS's grouped GEMM on a GPU; on a CPU machine it
must say so and stop, not fail later with a CUDA error. Its recorded H200 table is checked for
what the results notes cite from it."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import grouped_gemm_skew  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only")
def test_without_a_gpu_the_command_says_so(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        grouped_gemm_skew.main(["--out", str(tmp_path / "s.json")])


def test_recorded_table_has_every_skew_and_offset_and_its_totals_add_up():
    report = json.loads((ROOT / "benchmarks/results/grouped-gemm-skew-h200.json").read_text())
    rows = report["rows"]
    assert {(r["zipf_exponent"], r["weight_offset_bytes"]) for r in rows} == {
        (z, o) for z in (0.0, 0.5, 1.0, 1.5) for o in (0, 16, 64)}
    for row in rows:
        assert row["total_ms"] == pytest.approx(sum(row["ms"].values()))
    aligned = {r["zipf_exponent"]: r for r in rows if r["weight_offset_bytes"] == 0}
    assert aligned[0.0]["max_over_mean"] < 1.1 < 7 < aligned[1.5]["max_over_mean"]
