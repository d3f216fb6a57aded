"""The campaign report: tables, pictures and a summary, saved with the run and shown as Prefect
artifacts. The pictures (loss curve, straggler heat maps, who-hung grids, expert load per MoE
stage) are inline in markdown artifacts, so the UI shows them with no file path to follow
(tests/scripts/test_ui_pictures.py checks that in headless Chromium)."""

from __future__ import annotations

import json

from prefect import task
from prefect.events import emit_event

from megatrain.config.campaign import CampaignConfig
from tasks._artifacts import create_markdown_artifact, create_table_artifact  # secrets hidden
from tasks._log import run_logger


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "-".join(parts).lower().replace("_", "-").replace(".", "-")


@task(name="sample-stage", retries=1, timeout_seconds=600)
def sample_stage(run_dir: str, count: int) -> list[dict]:
    """A few texts from the stage's final committed checkpoint (on CPU, fixed seed), saved beside
    its metrics for the report. Kept when present: a rerun of a finished campaign samples nothing."""
    from pathlib import Path

    from megatrain.evaluate.generate import DEFAULT_PROMPTS, sample_texts
    from megatrain.report.campaign import SAMPLES_FILE

    path = Path(run_dir) / SAMPLES_FILE
    if path.exists():
        return json.loads(path.read_text())
    samples = sample_texts(run_dir, DEFAULT_PROMPTS[:count])
    path.write_text(json.dumps(samples, indent=2))
    run_logger().info("%d samples from step %s in %s", len(samples), samples[0]["step"] if samples else "-", path)
    return samples


@task(name="write-report", retries=1, timeout_seconds=300)
def write_report(campaign: CampaignConfig, stage_results: list[dict]) -> dict:
    from megatrain.report.campaign import build_report
    from megatrain.report.expert_load import TITLE as EXPERT_LOAD
    from megatrain.report.runs import markdown_image

    report = build_report(campaign.campaign_dir, stage_results)
    summary = {**report.summary, "fingerprint": campaign.fingerprint()}  # rerun check: the same math
    stages = [{k: ", ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()} for row in summary["stages"]]
    create_table_artifact(stages, key=artifact_key(campaign.id, "stages"), description="stages of the campaign")
    create_table_artifact(summary["checkpoints"], key=artifact_key(campaign.id, "checkpoints"),
                          description="committed checkpoints")
    create_markdown_artifact(
        f"### Loss, campaign `{campaign.id}`\n\n{markdown_image(report.pictures['loss curve'], 'loss curve')}\n\n"
        "Solid: training loss, dashed: validation loss, per stage; red x: restart, orange v: rollback; "
        "pink dash-dot line: the step an attempt resumed from.\n",
        key=artifact_key(campaign.id, "loss-curve"), description="loss curve (training and validation, per stage)")
    expert_load = [markdown_image(png, title) for title, png in report.pictures.items() if title.endswith(EXPERT_LOAD)]
    if expert_load:  # an MoE campaign: layers x experts, each expert's share of the routed slots per stage
        create_markdown_artifact(
            f"### Expert load, campaign `{campaign.id}`\n\n" + "\n\n".join(expert_load) + "\n\nEach cell: the expert's "
            "share of its layer's routed slots over the stage; colour: load relative to balanced (1 / experts).\n",
            key=artifact_key(campaign.id, "expert-load"), description="expert load per stage (MoE layers x experts)")
    create_markdown_artifact(report.ui_markdown, key=artifact_key(campaign.id, "report"), description="campaign report")

    report_dir = campaign.campaign_dir / "report"
    (report_dir / "report.md").write_text(report.markdown)
    (report_dir / "report.json").write_text(json.dumps(summary, indent=2))
    run_logger().info("report written to %s", report_dir / "report.md")
    # `prefect deployment run ... --watch` shows events, not logs: this one names the report.
    emit_event(event="megatrain.report.written",
               payload={"faults": len(summary["faults"]), "interrupts": len(summary["interrupts"])},
               resource={"prefect.resource.id": f"megatrain.config.campaign.{campaign.id}",
                         "prefect.resource.name": str(report_dir / "report.md")})
    return summary
