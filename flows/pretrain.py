"""The pretraining campaign: validate -> shard data -> self-check -> stages in order -> report.

Rerun a failed or crashed run (the UI's Retry, or a new run of the same campaign) and finished
stages come back from the cache while the interrupted one resumes from its last committed
checkpoint.
"""

from __future__ import annotations

import sys

from prefect import flow

from tasks.campaign import validate_campaign
from tasks.data import shard_campaign_data
from tasks.report import write_report
from tasks.selfcheck import run_self_check
from tasks.train import train_stage

DEFAULT_CAMPAIGN = "configs/campaign-local.yaml"


@flow(name="pretrain", log_prints=True)
def pretrain(campaign_path: str = DEFAULT_CAMPAIGN, overrides: list[str] | None = None) -> dict:
    campaign = validate_campaign(campaign_path, overrides or [])
    shards = shard_campaign_data(campaign)
    if campaign.self_check:
        run_self_check(campaign)
    results = [train_stage(campaign, index, shards[index]["version"]) for index in range(len(campaign.stages))]
    return write_report(campaign, results)


def print_summary(report: dict) -> None:
    print(f"\ncampaign {report['campaign']} finished")
    for row in report["stages"]:
        print(f"  stage {row['stage']}: {row['steps']} steps, loss {row['first loss']} -> {row['final loss']}, "
              f"{row['tokens/s']} tokens/s, {row['restarts']} restarts, {row['rollbacks']} rollbacks")
    print(f"  checkpoints: {len(report['checkpoints'])} committed, newest {report['checkpoints'][-1]['url'] if report['checkpoints'] else '-'}")
    print(f"  report: {report['report']}\n  loss curve: {report['loss_curve']}")


if __name__ == "__main__":
    print_summary(pretrain(*(sys.argv[1:2] or [DEFAULT_CAMPAIGN]), overrides=sys.argv[2:]))
