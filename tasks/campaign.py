"""Validate a campaign before anything heavy starts: every field, every input it names, and every
location it writes (the preflight)."""

from __future__ import annotations

from prefect import task

from megatrain.config.campaign import CampaignConfig, load_campaign, stage_config
from megatrain.config import compat
from megatrain.errors import InputError
from tasks._log import run_logger
from tasks._retry import unless_deterministic


def check_inputs(campaign: CampaignConfig) -> None:
    """Every stage's data sources (a path that exists, a glob that matches) and tokenizer file
    exist: a missing input fails here, naming the stage and field, before any rank starts.
    Raises ``InputError`` (deterministic: no retry can help)."""
    from megatrain import storage

    for index, stage in enumerate(campaign.stages):
        data = stage_config(campaign, index).data
        named = [("data.sources", s) for s in data.sources] if data.mixture is None else [
            (f"data.mixture component {c.name!r}", s) for c in data.mixture for s in c.sources]
        for field, source in named:
            if source == "stdlib":
                continue
            glob = any(ch in source for ch in "*?[")
            if not (storage.glob(source) if glob else storage.exists(source)):
                what = "matches no file" if glob else "does not exist"
                raise InputError(f"stage {stage.name}: {field} source {source!r} {what}")
        if data.tokenizer != "bpe" and not storage.exists(data.tokenizer):
            raise InputError(f"stage {stage.name}: data.tokenizer {data.tokenizer!r} does not exist")


def check_locations(campaign: CampaignConfig) -> None:
    """Every stage's run dir, staging dir and durable store take a write and have room for two
    checkpoints (``megatrain/reliability/preflight.py``): a read-only or too small location fails
    here, in one line naming it and the bytes, before any rank starts. Raises a deterministic
    error, or ``StorageError`` for an outage (retried). A Kubernetes stage's run and staging dirs
    live on its pods' disks: its rank 0 probes those."""
    from megatrain.reliability.preflight import preflight

    for index in range(len(campaign.stages)):
        # train.dtype auto: bf16, the smaller checkpoint (the worker does not know the ranks'
        # device); rank 0 checks again with the dtype it resolved
        preflight(stage_config(campaign, index), campaign.world_size, campaign.nproc_per_node, cuda=True,
                  local=campaign.launcher == "local")


@task(name="validate-campaign", retries=2, retry_delay_seconds=[2, 5], retry_condition_fn=unless_deterministic,
      timeout_seconds=60)
def validate_campaign(campaign_path: str, overrides: list[str] | None = None) -> CampaignConfig:
    """Every stage is resolved into a full run config and validated, its inputs checked and the
    locations it writes probed; a bad field, a missing input or a location that cannot take the
    run's writes fails here, at once. Only an outage (of the storage holding inputs or
    checkpoints) is retried."""
    campaign = load_campaign(campaign_path, overrides)
    check_inputs(campaign)
    check_locations(campaign)
    logger = run_logger()
    for index, stage in enumerate(campaign.stages):
        cfg = stage_config(campaign, index)
        logger.info("stage %s: %d steps, seq %d, global batch %d, %s block, lr %.1e (config %s)",
                    stage.name, stage.steps, cfg.seq_len, cfg.train.global_batch_size,
                    cfg.model.block, cfg.optim.lr, compat.fingerprint(cfg))
    return campaign
