"""The campaign report names where each restore came from (keeper, peer, durable) and what it cost,
from each stage's restores.jsonl (written by the ranks' checkpointer, megatrain/checkpoint/manager.py)."""

from __future__ import annotations

import json

from test_campaign_report import make_campaign

from megatrain.report.campaign import build_report, read_restores


def test_report_has_a_line_per_restore_with_its_tier_and_cost(tmp_path):
    campaign = make_campaign(tmp_path)
    rows = [{"time": 1.0, "tier": "keeper", "step": 6, "durable_step": 4, "seconds": 0.1234, "world_size": 2},
            {"time": 2.0, "tier": "durable", "step": 12, "durable_step": 12, "seconds": 0.51, "world_size": 2}]
    # a third row cut short by a killed writer: skipped, never a failed report
    (campaign / "a-first" / "restores.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"time": 3.0, "ti')
    (campaign / "b-second" / "restores.jsonl").write_text(json.dumps({**rows[0], "tier": "peer", "step": 5}) + "\n")

    assert [r["tier"] for r in read_restores(campaign / "a-first")] == ["keeper", "durable"]
    report = build_report(campaign)
    assert [(r["stage"], r["tier"], r["step"]) for r in report.summary["restores"]] == [
        ("a-first", "keeper", 6), ("a-first", "durable", 12), ("b-second", "peer", 5)]
    for markdown in (report.markdown, report.ui_markdown):
        assert "## Restores" in markdown
        assert ("* `a-first` restored step 6 from the **keeper** tier in 0.123 s (newest durable step 4, "
                "2 steps newer)") in markdown
        assert "* `a-first` restored step 12 from the **durable** tier in 0.510 s (newest durable step 12)" in markdown
        assert "* `b-second` restored step 5 from the **peer** tier in 0.123 s (newest durable step 4, 1 step newer)" \
            in markdown


def test_report_without_restores_has_no_restores_section(tmp_path):
    report = build_report(make_campaign(tmp_path))
    assert report.summary["restores"] == [] and "## Restores" not in report.markdown
