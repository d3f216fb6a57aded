"""Shard a campaign's corpus into webdataset shards (idempotent; usable on its own)."""

from __future__ import annotations

import sys

from prefect import flow

from tasks.campaign import validate_campaign
from tasks.data import shard_campaign_data


@flow(name="shard-data")
def shard_data(campaign_path: str = "configs/campaign-local.yaml", overrides: list[str] | None = None) -> list[dict]:
    campaign = validate_campaign(campaign_path, overrides or [])
    return shard_campaign_data(campaign)


if __name__ == "__main__":
    shard_data(*sys.argv[1:2], overrides=sys.argv[2:])
