"""Shard a campaign's corpus (idempotent; usable on its own), and the Dask engine's flow.

``shard_campaign_data`` is what ``pretrain`` runs first: each stage's data, each mixture
component once (a component shared by stages has one content-addressed version).

``shard-data`` shards every stage's data of a campaign. ``shard-corpus`` is a stage's corpora on
a dask.distributed cluster (``data.engine: dask``): the plans, then all their work units mapped as
Prefect tasks on a ``DaskTaskRunner`` (the scheduler at ``data.dask_address``, else a
``LocalCluster`` of ``data.num_workers`` worker processes of one task thread each, each given its
share of the cores for its tokenizer), then the indexes. A worker lost mid-unit
costs that unit only: Dask runs its task again elsewhere and the unit, which never wrote its
unit.json, is sharded anew; a rerun of the flow skips every finished unit.
"""

from __future__ import annotations

import os
import sys

from prefect import flow

from tasks.campaign import validate_campaign
from megatrain.config.campaign import CampaignConfig, stage_config
from megatrain.data.shard_unit import WORKER_CORES_ENV
from megatrain.data.tokenizer import machine_cores
from tasks.data import finish_shards, plan_shards, shard_one_unit, shard_stage_data


def dask_runner(data_config: dict):
    """The task runner of data_config's Dask cluster: its scheduler, or a LocalCluster here."""
    from prefect_dask import DaskTaskRunner

    if data_config.get("dask_address"):
        return DaskTaskRunner(address=data_config["dask_address"])
    workers = data_config.get("num_workers") or machine_cores()
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
        "n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None,
        "host": "127.0.0.1",  # scheduler, nannies and workers listen on loopback only
        "env": _worker_env(data_config.get("worker_cores") or max(1, machine_cores() // workers)),
    })


def _worker_env(cores: int) -> dict[str, str]:
    """What each local worker process runs with. Its tokenizer (and Arrow) get the cores the
    worker is given: a share of this machine's (``MEGATRAIN_WORKER_CORES``, read by its first
    shard-unit task before the tokenizer is loaded). Its task runs report to this flow's Prefect
    server (without the address, each worker started a temporary server of its own, ~10 s of CPU
    each, and its task runs were recorded there, not where the UI looks), and its console shows
    warnings only: the task runs' lines still reach the flow run's log through the API."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # the running server, temporary or not
        api_url = str(client.api_url)
    return {WORKER_CORES_ENV: str(cores), "TOKENIZERS_PARALLELISM": "true" if cores > 1 else "false",
            "OMP_NUM_THREADS": str(cores), "PREFECT_API_URL": api_url, "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}


@flow(name="shard-corpus", log_prints=True)
def _shard_corpora(data_configs: list[dict], seq_len: int, vocab_size: int) -> list[dict]:
    """Corpora on the flow's Dask cluster: each planned, the units of all of them mapped as one set
    of tasks (largest first, so the last to run is a small one), each finished."""
    from megatrain.data.shard_unit import load_plan

    planned = [plan_shards(c, seq_len, vocab_size) for c in data_configs]
    plan_urls = list(dict.fromkeys(p["plan_url"] for p in planned if "done" not in p))  # a version once
    jobs = [(url, i) for url in plan_urls for i in range(len(load_plan(url).units))]
    jobs.sort(key=lambda job: -load_plan(job[0]).units[job[1]].bytes)
    units = shard_one_unit.map([url for url, _ in jobs], [i for _, i in jobs]) if jobs else []
    finished = {url: finish_shards(url, wait_for=[units]) for url in plan_urls}
    return [p["done"] if "done" in p else finished[p["plan_url"]] for p in planned]


def shard_corpora_on_dask(data_configs: list[dict], seq_len: int, vocab_size: int,
                          log_path: str | None = None) -> list[dict]:
    """Corpora on their Dask cluster (the first's: components share a data section), a subflow
    when called from a flow. Dask's own log lines go to ``log_path`` (default: ``dask.log``
    beside a local corpus's shards, else in ``./logs/``), not the console."""
    from flows.dask_scheduler import scheduler_named
    from megatrain.observe.library_logs import to_file

    shard_url = str(data_configs[0].get("shard_url") or "")
    default = os.path.join(shard_url if shard_url and "://" not in shard_url else "logs", "dask.log")
    address = data_configs[0].get("dask_address")  # a scheduler that is gone, or goes: one line naming it
    with to_file(log_path or default), scheduler_named(address, f"sharding {len(data_configs)} corp{'us' if len(data_configs) == 1 else 'ora'}") as check:
        flow = _shard_corpora.with_options(task_runner=dask_runner(data_configs[0]))
        return check(flow(data_configs, seq_len, vocab_size))


def shard_corpus_on_dask(data_config: dict, seq_len: int, vocab_size: int, log_path: str | None = None) -> dict:
    """One corpus on its Dask cluster (``shard_corpora_on_dask``)."""
    return shard_corpora_on_dask([data_config], seq_len, vocab_size, log_path)[0]


def shard_corpora_here(data_configs: list[dict], seq_len: int, vocab_size: int,
                       log_path: str | None = None) -> list[dict]:
    """Corpora on their engine (the first's): one task on the local process pool, or the
    shard-corpus flow on Dask."""
    if data_configs[0].get("engine", "local") == "dask":
        return shard_corpora_on_dask(data_configs, seq_len, vocab_size, log_path)
    return shard_stage_data(data_configs, seq_len, vocab_size)


def shard_campaign_data(campaign: CampaignConfig) -> list[dict]:
    """Each stage's data: {"version", "components": [{name, weight, url, ...}]}. A stage's
    components are sharded together (one pool, or one set of Dask tasks); a component (or a
    stage's plain corpus) shared by stages is sharded once: its version is content-addressed."""
    from megatrain.data.shard import component_configs, mixture_tokenizer

    results, done = [], {}
    for index in range(len(campaign.stages)):
        cfg = stage_config(campaign, index)
        data = mixture_tokenizer(cfg.data, cfg.model.vocab_size)  # a mixture's BPE: trained once, on all
        keyed = [((c.model_dump_json(), cfg.seq_len, cfg.model.vocab_size), c) for c in component_configs(data)]
        todo = {key: c.model_dump(mode="json") for key, c in keyed if key not in done}
        if todo:
            sharded = shard_corpora_here(list(todo.values()), cfg.seq_len, cfg.model.vocab_size,
                                         str(campaign.campaign_dir / "logs" / "dask.log"))
            done.update(zip(todo, sharded))
        components = [{"name": c.name, "weight": c.weight, **done[key]} for c, (key, _) in zip(data.components(), keyed)]
        version = components[0]["version"] if len(components) == 1 else "+".join(c["version"] for c in components)
        results.append({"version": version, "components": components})
    return results


@flow(name="shard-data")
def shard_data(campaign_path: str = "configs/campaign-local.yaml", overrides: list[str] | None = None) -> list[dict]:
    campaign = validate_campaign(campaign_path, overrides or [])
    return shard_campaign_data(campaign)


if __name__ == "__main__":
    shard_data(*sys.argv[1:2], overrides=sys.argv[2:])
