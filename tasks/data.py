"""The tasks that shard a corpus (``flows/shard_data.py`` puts them together).

``data.engine: local`` (the default) shards a stage's corpora (its mixture's components) in one
``shard-data`` task, their units on the engine's one process pool. ``data.engine: dask`` runs a
``plan-shards`` per corpus, one ``shard-unit`` task per work unit on a dask.distributed cluster,
and a ``finish-shards`` per corpus. Either way the engine skips what is done
(a complete version, a finished unit) and every engine writes the same index. Only I/O failures
are retried; bad input fails at once.
"""

from __future__ import annotations

from prefect import task

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


def summary(index) -> dict:
    return {"url": index.url, "version": index.version, "num_samples": index.num_samples, "shards": len(index.shards),
            "bad_sources": len(index.bad_sources), "tokenizer_sha256": index.tokenizer_sha256,
            "replaced_bytes": sum(index.replaced_bytes.values())}  # input bytes not UTF-8, now U+FFFD


@task(name="shard-data", retries=2, retry_delay_seconds=10, retry_condition_fn=_transient, timeout_seconds=3600)
def shard_stage_data(data_configs: list[dict], seq_len: int, vocab_size: int) -> list[dict]:
    """Tokenize and pack corpora (a stage's mixture components) on the local engine, their units on
    one process pool. Skipped by the engine itself for each corpus whose index with the same
    fingerprint (inputs, tokenizer, packing) exists at the shard URL: a Prefect cache would also
    skip it when the shards were deleted since, so there is none here."""
    from megatrain.config import DataConfig
    from megatrain.data.shard import shard_corpora

    indexes = shard_corpora([DataConfig.model_validate(c) for c in data_configs], seq_len, vocab_size)
    for index in indexes:
        run_logger().info("shards at %s: %d samples in %d shards (version %s)%s", index.url, index.num_samples,
                          len(index.shards), index.version, _refused(index))
    return [summary(index) for index in indexes]


def _refused(index) -> str:
    from megatrain.data.index import describe_replaced

    refused = f"; {len(index.bad_sources)} source files refused and left out (data.on_bad_source=skip)" \
        if index.bad_sources else ""
    return refused + (f"; {describe_replaced(index.replaced_bytes)}" if index.replaced_bytes else "")


@task(name="plan-shards", retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def plan_shards(data_config: dict, seq_len: int, vocab_size: int) -> dict:
    """The version's plan (its units), or the summary of its index when the version is complete."""
    from megatrain.config import DataConfig
    from megatrain.data.shard import plan_sharding
    from megatrain.data.index import ShardIndex

    plan = plan_sharding(DataConfig.model_validate(data_config), seq_len, vocab_size)
    if isinstance(plan, ShardIndex):
        return {"done": summary(plan)}
    run_logger().info("plan %s: %d units, %d sources refused", plan.url, len(plan.units), len(plan.bad_sources))
    return {"plan_url": plan.url, "units": len(plan.units)}


@task(name="shard-unit", retries=2, retry_delay_seconds=5, retry_condition_fn=_transient)
def shard_one_unit(plan_url: str, i: int) -> dict:
    """One work unit, on whichever worker runs it; a finished unit (its unit.json) is skipped."""
    from megatrain.data.shard_unit import shard_unit_on_worker

    record = shard_unit_on_worker(plan_url, i)  # the worker's tokenizer threads: the cores it is given
    return {"unit": i, "documents": record["documents"], "tokens": record["tokens"],
            "samples": sum(s["num_samples"] for s in record["shards"])}


@task(name="finish-shards", retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def finish_shards(plan_url: str) -> dict:
    from megatrain.data.shard import finish_sharding
    from megatrain.data.shard_unit import load_plan

    index = finish_sharding(load_plan(plan_url))
    run_logger().info("shards at %s: %d samples in %d shards (version %s)%s", index.url, index.num_samples,
                      len(index.shards), index.version, _refused(index))
    return summary(index)
