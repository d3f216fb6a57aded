"""One set of numbers, checked on a campaign a flow test has just run: the flow's summary (the dict
``pretrain`` returns, or the lines ``python -m flows.pretrain`` printed), ``megatrain status
--json``, ``report/report.json`` and TensorBoard (the report's ``report/tb`` scalars and each
stage's own per-step curves) say the same attempts, faults, interrupts, steps, tokens and tokens/s,
and those match what the stage's files hold (its attempt logs, its metrics rows).

Not a test module: the flow tests call ``assert_numbers_agree`` on the campaign they ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.observe.tensorboard import read_scalars
from megatrain.report.records import human_count, read_stage
from megatrain.report.status import campaign_status

KEYS = ("steps", "tokens", "tokens/s", "attempts", "faults", "interrupts", "restarts", "rollbacks")


def printed_rows(output: str) -> tuple[dict[str, dict], int, int]:
    """The flow summary's stage rows ({stage: {steps, tokens, tokens/s, attempts}}, CPU: no MFU
    column), its fault count and its interrupt count, from what the command printed."""
    lines = output.splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "steps"])
    rows = {}
    for line in lines[header + 1:]:
        if line.strip().startswith("faults detected"):
            break
        name, steps, _loss, _val, tokens, rate, attempts = line.split()[:7]
        rows[name] = {"steps": int(steps), "tokens": tokens, "tokens/s": int(rate.replace(",", "")),
                      "attempts": int(attempts)}
    faults = next(int(line.rsplit(":", 1)[1]) for line in lines if line.strip().startswith("faults detected"))
    interrupts = next((int(line.rsplit(":", 1)[1]) for line in lines if line.strip().startswith("interrupts")), 0)
    return rows, faults, interrupts


def assert_numbers_agree(campaign_dir: Path, summary: dict | None = None, printed: str | None = None) -> dict:
    """Every reader's numbers per stage, asserted equal; returns them ({stage: {key: value}})."""
    report = json.loads((campaign_dir / "report" / "report.json").read_text())
    status = {s.name: s for s in campaign_status(campaign_dir).stages}
    board = read_scalars(campaign_dir / "report" / "tb")
    numbers = {}
    for row in report["stages"]:
        name = row["stage"]
        records, stage = read_stage(campaign_dir / name), status[name]
        ours = {key: row[key] for key in KEYS}
        numbers[name] = ours
        # status says the same
        assert {"steps": stage.last_step, "tokens": stage.tokens, "tokens/s": round(stage.tokens_per_s),
                "attempts": stage.attempts, "faults": stage.faults, "interrupts": stage.interrupts,
                "restarts": stage.restarts, "rollbacks": stage.rollbacks} == ours, name
        # and the stage's files: an attempt per log file, every ended attempt a fault, an interrupt or done
        logs = [p for p in (campaign_dir / name / "logs").glob("attempt-*.log") if ".rank" not in p.name]
        assert ours["attempts"] == len(logs) == len(records.attempts), (name, logs)
        completed = sum(a["status"] == "completed" for a in records.attempts)
        assert ours["faults"] + ours["interrupts"] + completed == ours["attempts"], (name, records.attempts)
        assert [r["step"] for r in records.timeline] == list(range(1, ours["steps"] + 1))
        # TensorBoard: the report's scalars, and the stage's own curve holds exactly the timeline's steps
        for key, tag in (("tokens", "tokens"), ("tokens/s", "tokens_per_s"), ("attempts", "attempts"),
                         ("faults", "faults"), ("interrupts", "interrupts")):
            assert board[f"campaign/{name}/{tag}"] == [(ours["steps"], float(ours[key]))], (name, key)
        curve = read_scalars(campaign_dir / name / "tb")
        assert [s for s, _ in curve["train/loss"]] == [r["step"] for r in records.timeline], name
        rates, times = dict(curve["perf/tokens_per_s"]), dict(curve["perf/step_time_s"])
        assert ours["tokens/s"] == pytest.approx(sum(rates[s] * times[s] for s in rates) / sum(times.values()),
                                                 rel=1e-4, abs=1), name
    if summary is not None:  # the flow's summary: the dict the flow returned
        assert {r["stage"]: {k: r[k] for k in KEYS} for r in summary["stages"]} == numbers
        assert (len(summary["faults"]), len(summary["interrupts"])) == (
            sum(n["faults"] for n in numbers.values()), sum(n["interrupts"] for n in numbers.values()))
    if printed is not None:  # the flow's summary as the command line printed it
        rows, faults, interrupts = printed_rows(printed)
        assert rows == {name: {"steps": n["steps"], "tokens": human_count(n["tokens"]), "tokens/s": n["tokens/s"],
                               "attempts": n["attempts"]} for name, n in numbers.items()}, printed[-3000:]
        assert (faults, interrupts) == (sum(n["faults"] for n in numbers.values()),
                                        sum(n["interrupts"] for n in numbers.values())), printed[-3000:]
    return numbers
