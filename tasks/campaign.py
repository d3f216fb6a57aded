"""Validate a campaign before anything heavy starts."""

from __future__ import annotations

from prefect import task

from megatrain.campaign import CampaignConfig, load_campaign, stage_config
from tasks._log import run_logger


@task(name="validate-campaign", retries=0, timeout_seconds=60)
def validate_campaign(campaign_path: str, overrides: list[str] | None = None) -> CampaignConfig:
    """Every stage is resolved into a full run config and validated; a bad field fails here."""
    campaign = load_campaign(campaign_path, overrides)
    logger = run_logger()
    for index, stage in enumerate(campaign.stages):
        cfg = stage_config(campaign, index)
        logger.info("stage %s: %d steps, seq %d, global batch %d, %s block, lr %.1e (config %s)",
                    stage.name, stage.steps, cfg.seq_len, cfg.train.global_batch_size,
                    cfg.model.block, cfg.optim.lr, cfg.fingerprint())
    return campaign
