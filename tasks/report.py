"""The campaign report: tables, a loss curve and a summary, saved with the run and shown as
Prefect artifacts."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from megatrain.campaign import CampaignConfig
from tasks._log import run_logger


def _key(*parts: str) -> str:
    return "-".join(parts).lower().replace("_", "-").replace(".", "-")


@task(name="write-report", retries=1, timeout_seconds=300)
def write_report(campaign: CampaignConfig, stage_results: list[dict]) -> dict:
    from megatrain.checkpoint.catalog import list_checkpoints
    from megatrain.observe.report import plot_loss, summarize_run

    report_dir = campaign.campaign_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    stage_rows, checkpoint_rows = [], []
    for result in stage_results:
        summary = summarize_run(result["run_dir"])
        stage_rows.append({
            "stage": result["stage"], "steps": summary.steps, "first loss": round(summary.first_loss, 4),
            "final loss": round(summary.final_loss, 4), "tokens/s": round(summary.tokens_per_s),
            "MFU %": None if summary.mfu is None else round(100 * summary.mfu, 1),
            "step ms": round(summary.step_time_ms, 1), "restarts": result["restarts"],
            "rollbacks": result["rollbacks"], "attempts": result["attempts"],
        })
        for info in list_checkpoints(result["durable_url"]):
            checkpoint_rows.append({"stage": result["stage"], "step": info.step, "committed": info.committed,
                                    "bytes": info.size_bytes, "url": info.url})

    loss_png = plot_loss({r["stage"]: r["run_dir"] for r in stage_results}, report_dir / "loss.png")
    create_table_artifact(stage_rows, key=_key(campaign.id, "stages"), description="stages of the campaign")
    create_table_artifact(checkpoint_rows, key=_key(campaign.id, "checkpoints"), description="committed checkpoints")
    create_link_artifact(loss_png.resolve().as_uri(), link_text="loss curve (PNG)", key=_key(campaign.id, "loss-curve"))

    events = [f"* `{r['stage']}` attempt {i + 1}: **{h['status']}** {h['message'][:200]}"
              for r in stage_results for i, h in enumerate(r["history"])]
    markdown = "\n".join([
        f"# Campaign `{campaign.id}`", "",
        "| stage | steps | final loss | tokens/s | restarts | rollbacks |", "|---|---|---|---|---|---|",
        *[f"| {r['stage']} | {r['steps']} | {r['final loss']} | {r['tokens/s']} | {r['restarts']} | {r['rollbacks']} |"
          for r in stage_rows],
        "", "## What happened", *events, "",
        f"Checkpoints: {len(checkpoint_rows)} committed; loss curve: `{loss_png}`",
    ])
    create_markdown_artifact(markdown, key=_key(campaign.id, "report"), description="campaign report")
    (report_dir / "report.md").write_text(markdown + "\n")
    summary = {"campaign": campaign.id, "stages": stage_rows, "checkpoints": checkpoint_rows,
               "loss_curve": str(loss_png), "report": str(report_dir / "report.md")}
    (report_dir / "report.json").write_text(json.dumps(summary, indent=2))
    run_logger().info("report written to %s", report_dir)
    return summary
