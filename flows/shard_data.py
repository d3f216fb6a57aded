"""Shard a campaign's corpus (idempotent; usable on its own), and the Dask engine's flow.

``shard_campaign_data`` is what ``pretrain`` runs first: each stage's data, each mixture
component once (a component shared by stages has one content-addressed version).

``shard-data`` shards every stage's data of a campaign. ``shard-corpus`` is one corpus on a
dask.distributed cluster (``data.engine: dask``): the plan, then its work units mapped as Prefect
tasks on a ``DaskTaskRunner`` (the scheduler at ``data.dask_address``, else a ``LocalCluster`` of
``data.num_workers`` single-threaded worker processes), then the index. A worker lost mid-unit
costs that unit only: Dask runs its task again elsewhere and the unit, which never wrote its
unit.json, is sharded anew; a rerun of the flow skips every finished unit.
"""

from __future__ import annotations

import os
import sys

from prefect import flow

from tasks.campaign import validate_campaign
from megatrain.config.campaign import CampaignConfig, stage_config
from tasks.data import finish_shards, plan_shards, shard_one_unit, shard_stage_data


def dask_runner(data_config: dict):
    """The task runner of data_config's Dask cluster: its scheduler, or a LocalCluster here."""
    from prefect_dask import DaskTaskRunner

    if data_config.get("dask_address"):
        return DaskTaskRunner(address=data_config["dask_address"])
    workers = data_config.get("num_workers") or os.cpu_count() or 1
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
        "n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None,
        "host": "127.0.0.1",  # scheduler, nannies and workers listen on loopback only
        "env": _worker_env(),
    })


def _worker_env() -> dict[str, str]:
    """What each local worker process runs with. Its tokenizer is single-threaded: one process
    per core is the parallelism. Its task runs report to this flow's Prefect server (without
    the address, each worker started a temporary server of its own, ~10 s of CPU each, and its
    task runs were recorded there, not where the UI looks), and its console shows warnings
    only: the task runs' lines still reach the flow run's log through the API."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # the running server, temporary or not
        api_url = str(client.api_url)
    return {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PREFECT_API_URL": api_url,
            "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}


@flow(name="shard-corpus", log_prints=True)
def _shard_corpus(data_config: dict, seq_len: int, vocab_size: int) -> dict:
    planned = plan_shards(data_config, seq_len, vocab_size)
    if "done" in planned:
        return planned["done"]
    units = shard_one_unit.map(planned["plan_url"], range(planned["units"]))
    return finish_shards(planned["plan_url"], wait_for=[units])


def shard_corpus_on_dask(data_config: dict, seq_len: int, vocab_size: int, log_path: str | None = None) -> dict:
    """One corpus on its Dask cluster (a subflow when called from a flow). Dask's own log lines go
    to ``log_path`` (default: ``dask.log`` beside a local corpus's shards, else in ``./logs/``), not
    the console."""
    from flows.dask_scheduler import scheduler_named
    from megatrain.observe.library_logs import to_file

    shard_url = str(data_config.get("shard_url") or "")
    default = os.path.join(shard_url if shard_url and "://" not in shard_url else "logs", "dask.log")
    address = data_config.get("dask_address")  # a scheduler that is gone, or goes: one line naming it
    with to_file(log_path or default), scheduler_named(address, "sharding 1 corpus") as check:
        return check(_shard_corpus.with_options(task_runner=dask_runner(data_config))(data_config, seq_len, vocab_size))


def shard_one_corpus(data_config: dict, seq_len: int, vocab_size: int, log_path: str | None = None) -> dict:
    """A corpus on its engine: a task here, or the shard-corpus flow on Dask."""
    if data_config.get("engine", "local") == "dask":
        return shard_corpus_on_dask(data_config, seq_len, vocab_size, log_path)
    return shard_stage_data(data_config, seq_len, vocab_size)


def shard_campaign_data(campaign: CampaignConfig) -> list[dict]:
    """Each stage's data: {"version", "components": [{name, weight, url, ...}]}. A component (or a
    stage's plain corpus) shared by stages is sharded once: its version is content-addressed."""
    from megatrain.data.shard import component_configs, mixture_tokenizer

    results, done = [], {}
    for index in range(len(campaign.stages)):
        cfg = stage_config(campaign, index)
        components = []
        data = mixture_tokenizer(cfg.data, cfg.model.vocab_size)  # a mixture's BPE: trained once, on all
        for component, component_data in zip(data.components(), component_configs(data)):
            key = (component_data.model_dump_json(), cfg.seq_len, cfg.model.vocab_size)
            if key not in done:
                done[key] = shard_one_corpus(component_data.model_dump(mode="json"), cfg.seq_len, cfg.model.vocab_size,
                                             str(campaign.campaign_dir / "logs" / "dask.log"))
            components.append({"name": component.name, "weight": component.weight, **done[key]})
        version = components[0]["version"] if len(components) == 1 else "+".join(c["version"] for c in components)
        results.append({"version": version, "components": components})
    return results


@flow(name="shard-data")
def shard_data(campaign_path: str = "configs/campaign-local.yaml", overrides: list[str] | None = None) -> list[dict]:
    campaign = validate_campaign(campaign_path, overrides or [])
    return shard_campaign_data(campaign)


if __name__ == "__main__":
    shard_data(*sys.argv[1:2], overrides=sys.argv[2:])
