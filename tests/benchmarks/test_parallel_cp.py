"""benchmarks/parallel.py's context-parallel schedule (``--schedule cp``) on CPU ranks: the real trainer
at the schedule's long length (512 on the tiny recipe), one process against cp=2 over 2 gloo ranks at
the same global batch. In fp32 the two loss curves must agree to 1e-5 over the 20 steps: the driver's
own tolerance (2e-2, for bf16 on GPUs) would let a misplaced chunk through."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # two launches of the real trainer: still part of make test


def test_cp2_schedule_matches_one_process_on_cpu(tmp_path):
    out = tmp_path / "cp.json"
    done = subprocess.run([sys.executable, "benchmarks/parallel.py", "--cpu", "--quick", "--schedule", "cp",
                           "--only", "lc-1gpu,lc-cp2", "--work-dir", str(tmp_path / "work"), "--out", str(out),
                           "--deadline", "500"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "model.seq_len=512" in report["shard"]["command"]  # the long length, shards included
    (row,) = report["derived"]["losses"]
    assert (row["run"], row["reference"], row["steps"]) == ("lc-cp2", "lc-1gpu", 20)
    assert row["max_abs_diff"] <= 1e-5 * row["first_loss"], row
    assert report["results"]["lc-cp2"]["tokens_per_s"] > 0
