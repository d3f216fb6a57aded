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

# Two attempts of 1 s steps: launched at 100, steps 1-4 (first step done at 102, a kill fires at
# t=106, the attempt ends at t=108), then launched at 110 (first step done at 113), steps 3-6 after
# a restart from the checkpoint at step 2 (steps 3 and 4 are redone), ended at 120.
STEPS = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 1.0)]
LAUNCHES = [100.0, 110.0]
ENDS = [(108.0, "crashed", 8.0), (120.0, "completed", 10.0)]  # (time, status, attempt wall)
FIRED = [(106.0, "fired-kill_rank.json")]
STEP_LINES = [(104.0, 4), (115.0, 4)]  # rank 0's progress lines (log_interval 2): step 4 of each attempt


def write_metrics(path: Path, startup: bool) -> Path:
    rows = [{"step": s, "step_time_s": t} for s, t in STEPS]
    if startup:  # each attempt's first row carries its start-up record
        rows[0]["startup"] = {"started_at": 100.5, "first_step_at": 101.0, "phases_s": {"imports": 1.0}}
        rows[4]["startup"] = {"started_at": 110.5, "first_step_at": 114.0, "phases_s": {"imports": 0.1}}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("startup", [True, False])
def test_ettr_and_the_lost_time_add_up_to_the_wall(tmp_path, startup) -> None:
    attempts = attempts_from_metrics(write_metrics(tmp_path / "metrics.jsonl", startup))
    assert [[r["step"] for r in a["rows"]] for a in attempts] == [[1, 2, 3, 4], [3, 4, 5, 6]]
    result = breakdown(attempts, LAUNCHES, ENDS, FIRED, STEP_LINES, t_start=95.0, t_end=121.0)
    assert result["productive_steps"] == 6 and result["iteration_s"] == 1.0
    assert result["ettr"] == pytest.approx(6 / 26)
    lost = result["lost_s"]
    assert lost["steps redone"] == 2.0
    assert lost["detection+teardown"] == 2.0  # fired at 106, ended at 108
    assert lost["between attempts"] == pytest.approx(2.0)  # ended at 108, the next launched at 110
    # the records say 101 and 114; without them the step-4 line less the steps after the first
    # (1 s each) says 101 (104 - 3: steps 2-4) and 114 (115 - 1: step 4)
    assert lost["launch -> first step (restarts)"] == pytest.approx(4.0)
    assert lost["first attempt: launch -> first step"] == pytest.approx(1.0)
    # attempt 1: 108 - 2 (detection) - 101 - 3 s of steps = 2; attempt 2: 120 - 114 - 3 = 3
    assert lost["loop outside the step timer (checkpoint saves, logging)"] == pytest.approx(5.0)
    assert lost["flow start, sharding, first launch"] == pytest.approx(5.0)
    assert lost["flow wrap-up after the last attempt"] == pytest.approx(1.0)
    assert sum(lost.values()) + result["productive_s"] == pytest.approx(26.0)
    # each productive step at its own time (here all 1 s, so the same less nothing slow)
    assert result["ettr_measured_steps"] == pytest.approx((sum(t for _, t in STEPS) - 2.0) / 26)
    assert result["startup_records"] is startup
    assert result["interruptions"] == [{"status": "crashed", "detection+teardown": 2.0, "between attempts": 2.0,
                                        "launch -> first step (restarts)": 4.0}]
    if startup:
        assert result["restart_phases_s"] == [{"imports": 0.1}]


def test_a_console_log_reads_back_as_records(tmp_path) -> None:
    from chaos_ettr import ATTEMPT_ENDED, records_from_console

    log = tmp_path / "console.log"
    log.write_text("13:32:46.155 | ERROR   | Task run 'launch-ranks-ba9' - attempt 1 ended: crashed after 76.5 s. x\n"
                   "not a log line\n")
    records = records_from_console(log, "20261124")
    [(when, match)] = records.find_all(ATTEMPT_ENDED)
    assert when == 1795527166.155 and match.group(2) == "crashed" and match.group(3) == "76.5"


def test_a_slow_step_is_lost_time_by_the_median_but_productive_at_its_measured_time() -> None:
    rows = [{"step": s, "step_time_s": t} for s, t in [(1, 1.0), (2, 3.0), (3, 1.0), (4, 1.0)]]
    rows[0]["startup"] = {"started_at": 100.5, "first_step_at": 101.0, "phases_s": {}}
    result = breakdown([{"startup": rows[0]["startup"], "rows": rows}], [100.0], [(107.0, "completed", 7.0)], [],
                       [], t_start=99.0, t_end=108.0)
    assert result["ettr"] == pytest.approx(4 * 1.0 / 9)  # 4 steps at the median 1 s
    assert result["lost_s"]["slow steps (above the median)"] == pytest.approx(2.0)
    assert result["ettr_measured_steps"] == pytest.approx(6.0 / 9)  # the slow step's 3 s count


def test_a_fault_ridden_through_is_not_the_cause_of_a_later_end(tmp_path) -> None:
    """A storage outage fires in attempt 1, which later ends in a loss spike of its own: detection
    is 0 (was: from the outage's firing to the end, and the loop's row below zero to match)."""
    attempts = attempts_from_metrics(write_metrics(tmp_path / "metrics.jsonl", True))
    ends = [(108.0, "anomaly", 8.0), (120.0, "completed", 10.0)]
    result = breakdown(attempts, LAUNCHES, ends, [(101.5, "fired-storage_outage-1.json")], STEP_LINES,
                       t_start=95.0, t_end=121.0)
    assert result["lost_s"]["detection+teardown"] == 0.0
    assert result["lost_s"]["loop outside the step timer (checkpoint saves, logging)"] >= 0.0
