"""benchmarks/ep_overlap.py runs on CPU (two gloo ranks, tiny shapes) and writes both timings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ep_overlap_smoke(tmp_path):
    out = tmp_path / "ep.json"
    done = subprocess.run([sys.executable, "benchmarks/ep_overlap.py", "--nproc", "2", "--device", "cpu", "--tokens", "64",
                           "--d-model", "32", "--expert-ff", "32", "--iters", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["on_ms"] > 0 and result["off_ms"] > 0 and result["args"]["nproc"] == 2
    assert "overlap saves" in done.stdout
