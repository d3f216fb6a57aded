"""The local sharding engine: the work units of one or more versions on one process pool.

Tokenizing, reading and JSON parsing are Python work under the GIL, so only processes spread them
over cores. Each worker is given an equal share of the machine's cores (``data.worker_cores``, by
default the cores over the workers) and its tokenizer gets that many threads, set in the worker
before its first unit (``tokenizer.use_cores``): one worker given one core then keeps to it, and
two workers on two cores shard twice as fast as one. Workers are spawned, not forked: forking a
process whose tokenizer threads ran can deadlock them.

The units of every version to shard go to one pool, largest first, so the pool starts once for a
whole mixture and its last busy moment is a small unit, not a large one that one worker runs while
the others wait. A unit's output depends on the unit alone, so the order changes nothing written.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from megatrain.data.shard_unit import WORKER_CORES_ENV, ShardPlan, load_plan, shard_unit
from megatrain.data.tokenizer import machine_cores, use_cores

log = logging.getLogger(__name__)

Job = tuple[ShardPlan, int]  # a version's plan and one of its units


def _worker_setup(cores: int) -> None:
    os.environ[WORKER_CORES_ENV] = str(cores)
    use_cores(cores)


def _shard_unit_at(url: str, i: int) -> tuple[str, int]:
    shard_unit(load_plan(url), i)  # the plan is read once per worker process
    return url, i


def shares(workers: int, worker_cores: int = 0) -> tuple[int, int]:
    """(workers, cores each): ``worker_cores``, or the machine's cores shared out (at least one)."""
    workers = max(1, workers)
    return workers, worker_cores or max(1, machine_cores() // workers)


def run_units(jobs: list[Job], workers: int, worker_cores: int = 0) -> Iterator[Job]:
    """Shard every job's unit on ``workers`` spawned processes, largest unit first, each given
    ``worker_cores`` cores (0: its share of the machine); yields each job when it is done.

    One worker (or one job) runs inline, its tokenizer's parallelism set for the duration: off on
    one core, on when it is given the whole machine; for another count the thread pool of this
    process cannot be resized, so a pool of one worker runs it. ``memory://`` versions live in
    this process only and always run inline. If the pool breaks (a worker killed), the jobs not yet
    done run inline after a warning: done units are skipped, the output is the same either way."""
    workers, cores = shares(min(workers, len(jobs)), worker_cores)
    order = sorted(jobs, key=lambda job: -job[0].units[job[1]].bytes)
    inline = [job for job in order if job[0].url.startswith("memory:")]
    pooled = [job for job in order if not job[0].url.startswith("memory:")]
    if pooled and (workers > 1 or cores not in (1, machine_cores())):
        try:
            yield from _pooled(pooled, workers, cores)
            pooled = []
        except BrokenProcessPool as exc:
            log.warning("sharding process pool failed (%s); the remaining units run in this process", exc)
    yield from _inline(inline + pooled, cores)


def _pooled(jobs: list[Job], workers: int, cores: int) -> Iterator[Job]:
    plans = {plan.url: plan for plan, _ in jobs}
    log.info("sharding %d units on %d worker%s of %d core%s each", len(jobs), workers, "" if workers == 1 else "s",
             cores, "" if cores == 1 else "s")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_setup, initargs=(cores,)) as pool:
        futures = [pool.submit(_shard_unit_at, plan.url, i) for plan, i in jobs]
        for future in as_completed(futures):
            url, i = future.result()
            yield plans[url], i


def _inline(jobs: list[Job], cores: int) -> Iterator[Job]:
    if not jobs:
        return
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if cores > 1 else "false"  # read at every encode_batch
    try:
        for plan, i in jobs:
            shard_unit(plan, i)
            yield plan, i
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
