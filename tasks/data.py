"""Shard the campaign's corpus (skipped when the index already matches)."""

from __future__ import annotations

from prefect import task

from megatrain.config.campaign import CampaignConfig, stage_config
from tasks._log import run_logger


def _transient(task, task_run, state) -> bool:
    """Retry only what a retry can fix: an I/O error (storage briefly away), never bad input
    (a ``DeterministicError`` or a ``DataError`` naming the file) or a bug."""
    from megatrain.data.index import DataError
    from megatrain.errors import DeterministicError

    try:
        state.result()
    except (DeterministicError, DataError):
        return False
    except OSError:
        return True
    except Exception:
        return False
    return False


@task(name="shard-data", retries=2, retry_delay_seconds=10, retry_condition_fn=_transient, timeout_seconds=3600)
def shard_stage_data(data_config: dict, seq_len: int, vocab_size: int) -> dict:
    """Tokenize and pack one stage's data. Skipped by the engine itself when an index with the
    same fingerprint (inputs, tokenizer, packing) exists at the shard URL: a Prefect cache would
    also skip it when the shards were deleted since, so there is none here."""
    from megatrain.config import DataConfig
    from megatrain.data.shard import shard_corpus

    index = shard_corpus(DataConfig.model_validate(data_config), seq_len, vocab_size)
    run_logger().info("shards at %s: %d samples in %d shards (version %s)",
                          index.url, index.num_samples, len(index.shards), index.version)
    return {"url": index.url, "version": index.version, "num_samples": index.num_samples, "shards": len(index.shards)}


def shard_campaign_data(campaign: CampaignConfig) -> list[dict]:
    """One shard version per distinct (data config, sequence length) among the stages."""
    results = []
    for index in range(len(campaign.stages)):
        cfg = stage_config(campaign, index)
        results.append(shard_stage_data(cfg.data.model_dump(mode="json"), cfg.seq_len, cfg.model.vocab_size))
    return results
