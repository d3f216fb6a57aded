"""Run the node self-check of a campaign on its own (before a long run, or after a fault)."""

from __future__ import annotations

import sys

from prefect import flow

from tasks.campaign import validate_campaign
from tasks.selfcheck import run_self_check


@flow(name="self-check")
def self_check(campaign_path: str = "configs/campaign-local.yaml", overrides: list[str] | None = None) -> dict:
    campaign = validate_campaign(campaign_path, overrides or [])
    return run_self_check(campaign)


if __name__ == "__main__":
    self_check(*sys.argv[1:2], overrides=sys.argv[2:])
