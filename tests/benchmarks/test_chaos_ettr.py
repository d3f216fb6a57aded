"""benchmarks/chaos_ettr.py: ETTR and its lost-time split from a run's records, with and without
the start-up records (the BEFORE engine wrote none)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos_ettr import attempts_from_metrics, breakdown  # noqa: E402

# Two attempts of 1 s steps: steps 1-4 (a kill fires at t=106, the attempt ends at t=108), then
# steps 3-6 after a restart from the checkpoint at step 2 (steps 3 and 4 are redone).
STEPS = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 1.0)]
ENDS = [(108.0, "crashed", 8.0), (120.0, "completed", 10.0)]  # (time, status, attempt wall): launches at 100, 110
FIRED = [(106.0, "fired-kill_rank.json")]


def write_metrics(path: Path, startup: bool) -> Path:
    rows = [{"step": s, "step_time_s": t} for s, t in STEPS]
    if startup:  # each attempt's first row carries its start-up record
        rows[0]["startup"] = {"started_at": 100.5, "first_step_at": 102.0, "phases_s": {"imports": 1.0}}
        rows[4]["startup"] = {"started_at": 110.5, "first_step_at": 113.0, "phases_s": {"imports": 0.1}}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("startup", [True, False])
def test_ettr_and_the_lost_time_add_up_to_the_wall(tmp_path, startup) -> None:
    attempts = attempts_from_metrics(write_metrics(tmp_path / "metrics.jsonl", startup))
    assert [[r["step"] for r in a["rows"]] for a in attempts] == [[1, 2, 3, 4], [3, 4, 5, 6]]
    result = breakdown(attempts, ENDS, FIRED, t_start=95.0, t_end=121.0)
    assert result["productive_steps"] == 6 and result["iteration_s"] == 1.0
    assert result["ettr"] == pytest.approx(6 / 26)
    lost = result["lost_s"]
    assert lost["steps redone"] == 2.0
    assert lost["detection+teardown"] == 2.0  # fired at 106, ended at 108
    assert lost["between attempts"] == pytest.approx(2.0)  # ended at 108, the next launched at 110
    assert lost["restart overhead"] == pytest.approx(6.0)  # its 10 s wall minus 4 s of steps
    assert lost["flow start, sharding, first launch"] == pytest.approx(5.0)
    assert lost["first attempt's start-up"] == pytest.approx(2.0)  # 8 s wall - 4 s steps - 2 s detection
    assert lost["flow wrap-up after the last attempt"] == pytest.approx(1.0)
    assert sum(lost.values()) + result["productive_s"] == pytest.approx(26.0)
    assert result["startup_records"] is startup
    if startup:
        assert result["interruptions"][0]["time to first step"] == pytest.approx(2.5)
        assert result["restart_phases_s"] == [{"imports": 0.1}]
