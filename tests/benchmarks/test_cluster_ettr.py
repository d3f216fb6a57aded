"""benchmarks/cluster_ettr.py: the fault schedule by wall time, the ETTR arithmetic (useful steps x the
fault-free steady step / wall time, redone steps not counted twice) and the per-fault windows, from
hand-written rows. No cluster runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster_ettr import (  # noqa: E402
    ettr, fault_windows, per_fault, report, schedule, steps_redone, useful_steps, verdict_for,
)


def rows(*pairs: tuple[float, int]) -> list[tuple[float, dict]]:
    return [(t, {"step": s, "loss": 7.0, "step_time_s": 0.5}) for t, s in pairs]


def test_schedule_20_minutes_every_4_rotates_classes_and_node_hosts():
    plan = schedule(20, 4)
    assert [f["at_s"] for f in plan] == [240, 480, 720, 960]  # not at 1200: the campaign's end
    assert [(f["kind"], f["node"]) for f in plan] == [("host_down", 3), ("partition", 2), ("slow_link", 1),
                                                       ("storage_host_down", 0)]
    assert plan[1]["duration_s"] == 2.0 and plan[2]["rate"] == "20mbit" and plan[3]["duration_s"] == 4.0


def test_schedule_8_minutes_every_2_and_no_node_host_hit_twice():
    assert [f["at_s"] for f in schedule(8, 2)] == [120, 240, 360]
    plan = schedule(30, 4, ["host_down"])  # node classes only: three hosts, then nothing left to hit
    assert [(f["at_s"], f["node"]) for f in plan] == [(240, 3), (480, 2), (720, 1)]
    plan = schedule(20, 4, ["host_down", "redis_host_down"])
    assert [f["kind"] for f in plan] == ["host_down", "redis_host_down", "host_down", "redis_host_down"]
    assert [f["node"] for f in plan if f["kind"] == "host_down"] == [3, 2]
    with pytest.raises(ValueError):
        schedule(20, 0)
    with pytest.raises(ValueError):
        schedule(20, 4, ["evict_node"])


def test_ettr_counts_the_highest_step_not_the_redone_rows():
    # steps 1-10 at 1 s, a fault, a restore of step 6: 7-10 again, then 11-12; launched at 0, ended at 20
    run = rows(*[(float(s), s) for s in range(1, 11)], *[(14.0 + i, s) for i, s in enumerate([7, 8, 9, 10, 11, 12])])
    assert useful_steps(run) == 12
    assert steps_redone(run) == 4
    out = ettr(run, step_s=1.0, wall_s=20.0)
    assert out["ettr"] == 0.6 and out["productive_s"] == 12.0 and out["rows"] == 16
    assert ettr(rows((1.0, 1), (2.0, 2)), step_s=0.5, wall_s=4.0)["ettr"] == 0.25
    with pytest.raises(ValueError):
        ettr(run, step_s=1.0, wall_s=0.0)


def test_windows_and_verdicts_belong_to_their_fault():
    faults = [{"time": 110.0}, {"time": 150.0}, {"time": 190.0}]
    assert fault_windows(faults, 100.0, 200.0) == [(100.0, 150.0), (110.0, 190.0), (150.0, 200.0)]
    verdicts = [{"detected_at": 113.5, "node": 3}, {"detected_at": 160.0, "node": 2}]
    assert verdict_for(faults[0], verdicts, 150.0)["node"] == 3
    assert verdict_for(faults[1], verdicts, 190.0)["node"] == 2
    assert verdict_for(faults[2], verdicts, 200.0) is None


def test_report_of_a_clean_and_a_faulted_campaign():
    # fault-free: launched at 0, rows every 1 s from 10 to 59 (steps 1-50), stopped at 60
    clean = {"name": "clean", "exit": 1, "start": 0.0, "stop": 60.0, "steps": 10**6,
             "rows": rows(*[(10.0 + i, i + 1) for i in range(50)])}
    # faulted: host_down at 20.3 in step 11 (step 11's row at 20.0), found at 23.5; the shrunk attempt
    # restores step 8 and redoes 9-11 at 30-32, then one a second to step 38 at 59
    faulted = {"name": "faulted", "exit": 1, "start": 0.0, "stop": 60.0, "steps": 10**6,
               "rows": rows(*[(10.0 + i, i + 1) for i in range(11)], *[(21.0 + s, s) for s in range(9, 39)]),
               "faults": [{"kind": "host_down", "node": 3, "host": "node3", "time": 20.3}],
               "verdicts": [{"node": 3, "detected_at": 23.5}], "attempts": [{"nodes": [0, 1, 2, 3]}, {"nodes": [0, 1, 2]}]}
    out = report(clean, faulted)
    assert out["step_s"] == 1.0
    assert out["runs"]["clean"]["ettr"] == round(50 / 60, 4)
    assert out["runs"]["faulted"]["ettr"] == round(38 / 60, 4)
    assert out["ettr_ratio"] == round(round(38 / 60, 4) / round(50 / 60, 4), 4)
    (m,) = out["faults"]
    assert m["detection_s"] == 3.2 and m["first_step_after_s"] == 9.7 and m["steps_redone"] == 3
    # past step 11 at 33.0: 33 - 20 (the last row before the fault) - 1 steady step = 12 s lost
    assert m["lost_s"] == 12.0 and m["at_s"] == 20.3
    assert "ETTR ratio" in out["table"] and "host_down" in out["table"]
    assert per_fault({**faulted, "faults": []}, 1.0) == []


def test_a_partition_ridden_out_recovers_when_its_link_is_up():
    # steps 1-20 at 1 s from 1; a 2 s partition at 5.5 (step 5's row at 5.0): no row until 9.0 (step 6),
    # then one a second; no verdict
    run = {"name": "faulted", "exit": 1, "start": 0.0, "stop": 30.0, "steps": 10**6,
           "rows": rows(*[(float(s), s) for s in range(1, 6)], *[(3.0 + s, s) for s in range(6, 21)]),
           "faults": [{"kind": "partition", "node": 2, "time": 5.5, "duration_s": 2.0}], "verdicts": []}
    (m,) = per_fault(run, 1.0)
    assert m["found_as"] == "not lost (link up)" and m["detection_s"] is None
    assert m["first_step_after_s"] == 3.5 and m["steps_redone"] == 0
    assert m["lost_s"] == 3.0  # step 6 at 9.0: 9 - 5 - 1 steady step


def test_own_pace_counts_each_attempts_new_steps_at_its_own_step_time():
    from cluster_ettr import own_pace

    # attempt 1 from 0: steps 1-10 one a second from 1; attempt 2 from 12: restores 6, redoes 6-10 and goes
    # on to 20 at 0.5 s a step from 14 (steps 6-20: 15 rows)
    run = rows(*[(float(s), s) for s in range(1, 11)], *[(14.0 + 0.5 * i, s) for i, s in enumerate(range(6, 21))])
    out = own_pace(run, [0.0, 12.0], wall_s=25.0)
    assert out["attempt_step_s"] == [1.0, 0.5]
    assert out["productive_s"] == 10 * 1.0 + 10 * 0.5 and out["ettr"] == 0.6
