"""Reports read the campaign where it is now: a campaign folder moved between stages, copied (the
original still there, or cleaned up), or reached through a symlink reports its own stages,
checkpoints, logs and model, and never a path the records stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_records import commit, row, stage_folder, write_attempts

from megatrain.report.campaign import build_report
from megatrain.report.console import summary_lines
from megatrain.report.status import campaign_status

STEPS = 8


def finished_campaign(campaign: Path) -> list[dict]:
    """Two stages, ``main`` then ``anneal`` (listed the other way round on disk), both finished;
    the anneal was interrupted once. Returns the flow's stage results, as its cache keeps them."""
    results = []
    for name, previous in (("main", None), ("anneal", "main")):
        stage = stage_folder(campaign, name, STEPS, previous)
        (stage / "metrics.jsonl").write_text("".join(json.dumps(row(s, 0.5)) + "\n" for s in range(1, STEPS + 1)))
        first = {"attempt": 1, "status": "stopped", "message": "stopped (SIGINT)", "metrics_rows": 2} if previous else \
            {"attempt": 1, "status": "crashed", "message": "rank 0 was killed by SIGKILL", "metrics_rows": 5}
        write_attempts(stage, first, {"attempt": 2, "status": "completed", "message": "", "metrics_rows": STEPS})
        commit(campaign, name, 4, STEPS)
        results.append({"stage": name, "steps": STEPS, "attempts": 1, "restarts": 0, "rollbacks": 0,
                        "history": [{"status": "completed"}], "run_dir": str(stage),
                        "durable_url": str(campaign / "durable" / name)})
    (campaign / "model").mkdir()
    (campaign / "anneal" / "export.json").write_text(json.dumps({
        "exported": True, "path": str(campaign / "model"), "architecture": "LlamaForCausalLM", "step": STEPS,
        "max_logit_diff": 0.0, "samples": []}))
    return results


def assert_reports_itself(campaign: Path, old: Path, stage_results: list[dict] | None = None) -> None:
    report = build_report(campaign, stage_results)
    summary = report.summary
    assert summary["finished"], summary["stages"]
    assert [(r["stage"], r["state"], r["steps"], r["attempts"]) for r in summary["stages"]] == [
        ("main", "done", STEPS, 2), ("anneal", "done", STEPS, 2)]
    assert [c["url"] for c in summary["checkpoints"]] == [
        str(campaign / "durable" / name / f"step-{step:08d}") for name in ("main", "anneal") for step in (4, STEPS)]
    assert [a["log"] for a in summary["attempts"]] == [
        str(campaign / name / "logs" / f"attempt-{n}.log") for name in ("main", "anneal") for n in (1, 2)]
    assert summary["export"]["path"] == str(campaign / "model")
    for text in (report.markdown, json.dumps(summary), "\n".join(summary_lines(summary))):
        assert str(old) not in text  # no stored absolute path
    assert "campaign camp: finished" in "\n".join(summary_lines(summary))
    status = campaign_status(campaign)
    assert [(s.name, s.state, s.durable_url) for s in status.stages] == [
        (name, "done", str(campaign / "durable" / name)) for name in ("main", "anneal")]
    assert all(log.startswith(str(campaign)) for s in status.stages for log in s.logs)


def test_a_campaign_moved_between_stages_reports_where_it_is_now(tmp_path):
    old, new = tmp_path / "a" / "camp", tmp_path / "b" / "camp"
    stage_results = finished_campaign(old)
    new.parent.mkdir()
    shutil.move(old, new)
    # the rerun after the move rewrote the stage it trained with the new paths; the finished
    # stage (a cached result) kept its config.yaml, and its result its old run_dir and durable URL
    stage_folder(new, "anneal", STEPS, "main")
    assert_reports_itself(new, old, stage_results)
    assert_reports_itself(new, old)  # ``megatrain report CAMPAIGN_DIR``: no results at all


def test_a_copy_reports_its_own_files_not_the_originals(tmp_path):
    """The original stays where it was and is cleaned up (its final checkpoint and logs gone): the
    copy's report, also read through a symlink, is the copy's. (A path beside a stage was read
    where it was recorded while that still existed: the original's checkpoints.)"""
    original, copy = tmp_path / "a" / "camp", tmp_path / "c" / "camp"
    finished_campaign(original)
    shutil.copytree(original, copy, symlinks=True)
    shutil.rmtree(original / "durable" / "main" / f"step-{STEPS:08d}")
    shutil.rmtree(original / "main" / "logs")
    assert_reports_itself(copy, original)
    link = tmp_path / "link"
    link.symlink_to(copy)
    status = campaign_status(link)
    assert status.finished and all(str(original) not in s.durable_url for s in status.stages)
    assert build_report(link).summary["finished"]
