"""benchmarks/cluster_faults.py: the report of the host fault classes (detection, first step after
recovery, steps redone, time lost, the ETTR estimate), its table and its JSON, from hand-written
fault markers, verdicts and metrics rows with the wall time each appeared. No cluster runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster_faults import (  # noqa: E402
    document, ettr_estimate, loss_differs_from, main, measure, report, steady_step_s, table,
)


def rows(*pairs: tuple[float, int], step_time_s: float = 0.5) -> list[tuple[float, dict]]:
    return [(t, {"step": s, "loss": 7.0, "step_time_s": step_time_s}) for t, s in pairs]


# fault-free: launched at 100, first row at 110, then a row every 1 s (step_time_s 0.5 s: the
# rank's own time, less than what a step costs the run), 12 steps
CLEAN = {"name": "clean", "exit": 0, "start": 100.0, "end": 122.0, "fault": None, "verdict": None, "steps": 12,
         "rows": rows(*[(110.0 + i, i + 1) for i in range(12)])}
STEADY = rows(*[(110.0 + i, i + 1) for i in range(12)])

# host_down at 108.3, in step 9 (step 8's row at 108.0); found at 111.5; the shrunk attempt restores
# the commit of step 4 and redoes 5-8 (rows at 120-123), step 9 at 124
HOST_DOWN = {"name": "host_down", "exit": 0, "start": 100.0, "steps": 12,
             "fault": {"kind": "host_down", "node": 3, "step": 8, "time": 108.3},
             "verdict": {"node": 3, "host": "node3", "detected_at": 111.5, "fault_time": 108.3},
             "rows": rows(*[(100.0 + s, s) for s in range(1, 9)], *[(115.0 + s, s) for s in range(5, 13)])}

# slow link at 108.2: steps 9-11 at 2.5 s each, evicted at 116.5 (cause slow_link); the shrunk attempt
# restores the commit of step 8 and redoes 9-11 (rows at 130-132), step 12 at 133
SLOW = {"name": "slow_link", "exit": 0, "start": 100.0, "steps": 12,
        "fault": {"kind": "slow_link", "node": 3, "step": 8, "time": 108.2},
        "verdict": {"node": 3, "cause": "slow_link", "detected_at": 116.5},
        "rows": rows(*[(100.0 + s, s) for s in range(1, 9)], (110.5, 9), (113.0, 10), (115.5, 11),
                     *[(121.0 + s, s) for s in range(9, 13)])}
# the same slow link never evicted: slow to the stage's end
SLOW_ON = {**SLOW, "verdict": None,
           "rows": rows(*[(100.0 + s, s) for s in range(1, 9)], (110.5, 9), (113.0, 10), (115.5, 11), (118.0, 12))}

# Redis down 4 s: no verdict, the store retried; step 9's row 2.5 s late, restored at 112.4
REDIS = {"name": "redis_host_down", "exit": 0, "start": 100.0, "steps": 12,
         "fault": {"kind": "redis_host_down", "node": 0, "step": 8, "time": 108.4, "restored": 112.4},
         "verdict": None,
         "rows": rows(*[(100.0 + s, s) for s in range(1, 9)], (111.5, 9), *[(103.0 + s, s) for s in range(10, 13)])}

# the fault never fired (the run died first): no numbers, and not counted as a free fault
UNFIRED = {"name": "partition", "exit": 1, "start": 100.0, "steps": 12, "fault": None, "verdict": None,
           "rows": rows((101.0, 1), (102.0, 2))}


def test_steady_step_is_the_wall_between_rows_not_the_ranks_own_time() -> None:
    assert steady_step_s(STEADY) == pytest.approx(1.0)
    # two rows only: no gaps to take the median of, the ranks' own step time
    assert steady_step_s(rows((1.0, 1), (3.0, 2), step_time_s=0.7)) == pytest.approx(0.7)


def test_a_lost_host_shrunk_and_redone() -> None:
    m = measure(HOST_DOWN, 1.0)
    assert m["found_as"] == "lost host" and m["fired"] is True
    assert m["detection_s"] == pytest.approx(3.2)  # 111.5 - 108.3
    assert m["first_step_after_s"] == pytest.approx(11.7)  # step 5's row at 120 after the verdict
    assert m["steps_redone"] == 4  # 5, 6, 7, 8 twice; not 12 - 8 and not the rows after the fault (8)
    # step 9 at 124, 16 s after step 8's row, where a steady run would have taken 1 s
    assert m["lost_s"] == pytest.approx(15.0)
    assert (m["final_step"], m["steps"]) == (12, 12)


def test_slow_link_and_a_store_outage() -> None:
    slow = measure(SLOW, 1.0)
    assert (slow["found_as"], slow["detection_s"], slow["steps_redone"]) == ("slow_link", 8.3, 3)
    assert slow["first_step_after_s"] == pytest.approx(21.8)
    # back once past step 11, the highest reached before the eviction: step 12 at 133, 25 s after step
    # 8's row where 4 steady steps take 4 s (not step 9's slow row at 110.5: 1.5 s)
    assert slow["lost_s"] == pytest.approx(21.0) and slow["recovered"] is True
    # the store back after the stage's last row, the ranks having trained on: lost until that row
    late = measure({**REDIS, "fault": {**REDIS["fault"], "restored": 120.0}}, 1.0)
    assert late["recovered"] is False and late["first_step_after_s"] is None
    assert late["lost_s"] == pytest.approx(3.0)  # step 12 at 115 where 4 steady steps after 108 end at 112
    on = measure(SLOW_ON, 1.0)
    assert on["recovered"] is False and on["found_as"] is None and on["first_step_after_s"] is None
    assert on["lost_s"] == pytest.approx(6.0)  # steps 9-12 took 10 s instead of 4: a floor, the fault outlived the stage
    redis = measure(REDIS, 1.0)
    assert redis["detection_s"] is None and redis["found_as"] == "service outage"
    assert redis["first_step_after_s"] == pytest.approx(4.6)  # step 10 at 113 after the restore at 112.4
    # back once past step 9 (the last before the restore): step 10 at 113, 5 s after step 8's row
    # where 2 steady steps take 2 s
    assert redis["lost_s"] == pytest.approx(3.0) and redis["steps_redone"] == 0


def test_a_fault_that_never_fired_has_no_numbers() -> None:
    m = measure(UNFIRED, 1.0)
    assert m["fired"] is False and m["final_step"] == 2
    assert all(m[k] is None for k in ("detection_s", "first_step_after_s", "lost_s", "found_as"))


def test_ettr_estimate() -> None:
    measured = [measure(r, 1.0) for r in (HOST_DOWN, SLOW, REDIS, UNFIRED)]
    ettr = ettr_estimate(measured, startup_s=10.0, minutes=20.0, every_minutes=4.0)
    mean = (15.0 + 21.0 + 3.0) / 3  # the three that gave a lost time; the unfired one is not a free 0
    assert ettr["faults"] == 5 and ettr["mean_lost_per_fault_s"] == pytest.approx(round(mean, 2))
    assert ettr["counted"] == ["host_down", "slow_link", "redis_host_down"]
    assert ettr["not_counted"] == ["partition"]
    assert ettr["ettr_without_faults"] == pytest.approx(round((1200 - 10) / 1200, 4))
    assert ettr["ettr_with_faults"] == pytest.approx(round((1200 - 10 - 5 * mean) / 1200, 4))
    assert ettr["ettr_ratio"] == pytest.approx(round((1190 - 5 * mean) / 1190, 4), abs=1e-4)
    # faults costing more than the campaign: ETTR 0, never negative
    assert ettr_estimate([{"class": "x", "lost_s": 900.0}], 10.0, 20.0, 4.0)["ettr_with_faults"] == 0.0
    with pytest.raises(ValueError, match="campaign-minutes"):
        ettr_estimate(measured, 10.0, 0.0, 4.0)


def test_report_table_and_json(tmp_path) -> None:
    runs = [HOST_DOWN, SLOW, REDIS, UNFIRED]
    out = report(runs, CLEAN, 20.0, 4.0)
    assert out["step_s"] == pytest.approx(1.0)
    assert out["ettr"]["startup_s"] == pytest.approx(10.0)  # the clean run's first row 10 s after its launch
    assert out["clean"] == {"exit": 0, "final_step": 12, "wall_s": 22.0}
    lines = out["table"].splitlines()
    assert lines[0].split() == ["class", "found", "as", "detect", "1st", "step", "redone", "lost", "steps"]
    by_class = {line.split()[0]: line for line in lines[2:6]}
    assert by_class["host_down"].split() == ["host_down", "lost", "host", "3.2", "s", "11.7", "s", "4", "15.0", "s",
                                             "12/12"]
    assert by_class["partition"].split() == ["partition", "-", "-", "-", "0", "-", "2/12"]
    assert "1000 ms" in out["table"] and "(5 faults, 13.0 s lost each)" in out["table"]
    assert "not in the mean (no lost time measured): partition" in out["table"]
    assert out["table"] == table(out["classes"], out["ettr"], out["step_s"])

    meta = {"command": "benchmarks/cluster_faults.py --steps 12", "commit": "abc1234", "work": "/var/tmp/x"}
    clean = {**CLEAN, "cluster": "mtc000001", "load": {"before": [1.0, 1, 1], "after": [2.0, 2, 2]},
             "left": {"netns": [], "links": [], "pids": []}}
    doc = json.loads(json.dumps(document(runs, clean, 20.0, 4.0, meta), default=str))
    assert set(doc) == {"step_s", "classes", "ettr", "table", "clean", "runs", "command", "commit", "work", "minutes",
                        "every_minutes"}
    assert [r["name"] for r in doc["runs"]] == ["clean", "host_down", "slow_link", "redis_host_down", "partition"]
    assert set(doc["runs"][0]) == {"name", "exit", "cluster", "start", "end", "steps", "fault", "verdict", "load",
                                   "left", "rows", "committed", "log_tail"}
    assert doc["runs"][0]["left"] == {"netns": [], "links": [], "pids": []}
    assert set(doc["classes"][0]) == {"class", "exit", "fired", "final_step", "steps", "steps_redone", "detection_s",
                                      "first_step_after_s", "lost_s", "found_as", "recovered", "loss_differs_from"}
    assert set(doc["ettr"]) == {"campaign_minutes", "every_minutes", "faults", "counted", "not_counted",
                                "mean_lost_per_fault_s", "startup_s", "ettr_without_faults", "ettr_with_faults",
                                "ettr_ratio"}

    # the report again from the JSON alone, as --report-from makes it: the same numbers
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(doc))
    assert main(["--report-from", str(path), "--out", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["classes"] == doc["classes"] and again["ettr"] == doc["ettr"] and again["commit"] == "abc1234"


def test_losses_against_the_clean_run_and_the_commits_after_a_store_outage() -> None:
    # the same losses step for step (a redone step counts by its last row): no difference
    assert loss_differs_from(HOST_DOWN["rows"], STEADY) is None
    other = rows(*[(100.0 + s, s) for s in range(1, 13)])
    other[9] = (other[9][0], {**other[9][1], "loss": 7.0000001})  # step 10, one bit off
    assert loss_differs_from(other, STEADY) == 10
    assert loss_differs_from(rows((101.0, 1), (102.0, 13)), STEADY) == 13  # a step the clean run lacks
    storage = {**REDIS, "name": "storage_host_down",
               "fault": {**REDIS["fault"], "kind": "storage_host_down"},
               "committed": {"4": {"committed_at": 104.5}, "8": {"committed_at": 112.9}, "12": {"committed_at": 115.0}}}
    m = measure(storage, 1.0, STEADY)
    assert m["loss_differs_from"] is None and m["committed"] == [4, 8, 12]
    assert m["committed_after_restore"] == [8, 12]  # restored at 112.4: 8 waited the outage out
    assert measure({**storage, "committed": {"error": "OSError: gone"}}, 1.0)["committed"] == "OSError: gone"
    line = table([m], ettr_estimate([m], 10.0, 20.0, 4.0), 1.0).splitlines()[-1]
    assert line == ("storage_host_down: losses vs the fault-free run: every step equal; committed [4, 8, 12], "
                    "after the restore [8, 12]")
