"""Run the node self-check of a campaign on its own (before a long run, or after a fault).

Triggered by an anomaly event (prefect.yaml), it gets the stage's run config and the nodes from
the event's resource, so it checks the campaign that raised it, not the file's default."""

from __future__ import annotations

import sys

from prefect import flow

from tasks.campaign import validate_campaign
from tasks.selfcheck import check_stage_nodes, run_self_check


@flow(name="self-check")
def self_check(campaign_path: str = "configs/campaign-local.yaml", overrides: list[str] | None = None,
               config_path: str = "", campaign_id: str = "", nodes: str = "", wait_idle_s: float = 900.0) -> dict:
    if config_path:  # from an anomaly event: that stage's config, once its ranks are idle
        return check_stage_nodes(config_path, campaign_id, nodes, wait_idle_s)
    campaign = validate_campaign(campaign_path, overrides or [])
    return run_self_check(campaign)


if __name__ == "__main__":
    self_check(*sys.argv[1:2], overrides=sys.argv[2:])
