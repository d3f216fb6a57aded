"""benchmarks/init.py: the traffic model equals what a real gloo start-up sends to the store,
and the simulation replays it on both real servers with the model's operation count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from init_traffic import count_ops, rank_phases, total_ops  # noqa: E402

from megatrain.parallel.dims import ParallelDims  # noqa: E402


def test_model_grows_linearly_ordered_and_quadratically_with_barriers() -> None:
    per_rank = {}
    for n in (256, 512, 1024):
        dims = ParallelDims(dp=n // 64, tp=8, pp=8)
        per_rank[n] = (total_ops(dims, "nccl", "ordered") / n, total_ops(dims, "nccl", "barrier", eager=False) / n)
    assert per_rank[256][0] == per_rank[1024][0]  # O(1) per rank: O(n) in all
    assert per_rank[1024][1] > 2 * per_rank[256][1]  # O(n) per rank: O(n^2) in all
    # a non-root rank of the eager NCCL path: claim, join barrier (add + wait), the world's unique id
    ops = count_ops([op for ops in rank_phases(5, ParallelDims(dp=4, tp=8, pp=8)).values() for op in ops])
    assert dict(ops) == {"compare_set": 1, "add": 1, "wait": 2, "get": 1, "set": 0}


@pytest.mark.slow
def test_real_traffic_matches_model_and_replays(tmp_path: Path) -> None:
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode:
        pytest.skip("redis-server not installed")
    proc = subprocess.run(
        [sys.executable, "benchmarks/init.py", "--ranks", "4", "--stores", "tcp", "--sim", "128",
         "--sim-barrier", "16", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # 0 only if the model matched
    report = json.loads(next(tmp_path.glob("*/init.json")).read_text())
    assert report["real"][0]["model_ok"]
    for row in report["sim"]:  # every simulated rank ran its whole program
        if row["mode"] == "barrier":  # torch's barrier: every rank that counts n sets the release key
            assert row["ops"] >= row["model_ops"], row
        else:
            assert row["ops"] == row["model_ops"], row
    assert {row["store"] for row in report["sim"]} == {"redis", "tcp"}
