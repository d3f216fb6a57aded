"""The local engine gives each worker its share of the cores, and its tokenizer that many threads;
the units of several versions share one pool, largest first (local_engine.py)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from data_helpers import SEQ_LEN, VOCAB, data_config

from megatrain.data import local_engine
from megatrain.data.shard import plan_sharding
from megatrain.data.tokenizer import machine_cores

DOCUMENTS = [f"document {i} with a few words of text to encode" for i in range(20000)]


def _threads_while_encoding(cores: int, tokenizer_json: str) -> tuple[int, int, str]:
    """In a fresh spawned process set up as a pool worker given ``cores``: its OS threads before
    and after a large encode_batch, and its TOKENIZERS_PARALLELISM."""
    from tokenizers import Tokenizer

    local_engine._worker_setup(cores)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    before = len(os.listdir("/proc/self/task"))
    tokenizer.encode_batch(DOCUMENTS)
    return before, len(os.listdir("/proc/self/task")), os.environ["TOKENIZERS_PARALLELISM"]


@pytest.mark.slow
def test_a_worker_tokenizes_on_the_cores_it_is_given(small_index) -> None:
    """One core: encode_batch starts no thread (the 173% CPU of one worker on 2 cores); three:
    the tokenizer's pool has three threads, whatever the machine has."""
    tokenizer_json = Path(small_index.tokenizer_url).read_text()
    context = multiprocessing.get_context("spawn")
    for cores, parallelism in ((1, "false"), (3, "true")):
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            before, after, said = pool.submit(_threads_while_encoding, cores, tokenizer_json).result(timeout=120)
        assert (after - before, said) == (0 if cores == 1 else cores, parallelism), cores


def _jobs(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    plans = [plan_sharding(data_config([str(corpus / name)], str(tmp_path / name), unit_bytes=1 << 16), SEQ_LEN, VOCAB)
             for name in ("colorsys.py", "textwrap.py")]
    seen: list[tuple[str, int, str | None]] = []
    monkeypatch.setattr(local_engine, "shard_unit",
                        lambda plan, i: seen.append((plan.url, i, os.environ.get("TOKENIZERS_PARALLELISM"))))
    return [(plan, i) for plan in plans for i in range(len(plan.units))], seen


def test_one_worker_runs_inline_on_its_cores_largest_unit_first(corpus: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    jobs, seen = _jobs(corpus, tmp_path, monkeypatch)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "unchanged")
    done = list(local_engine.run_units(jobs, workers=1, worker_cores=1))
    by_size = sorted(jobs, key=lambda job: -job[0].units[job[1]].bytes)
    assert done == by_size and done == jobs[::-1]  # textwrap.py (~19 KB) before colorsys.py (~4 KB)
    assert [s[2] for s in seen] == ["false"] * len(jobs)  # one core: no tokenizer threads
    assert os.environ["TOKENIZERS_PARALLELISM"] == "unchanged"  # this process's setting is put back
    seen.clear()
    list(local_engine.run_units(jobs, workers=1, worker_cores=machine_cores()))
    assert [s[2] for s in seen] == ["true" if machine_cores() > 1 else "false"] * len(jobs)


def test_cores_are_shared_out_among_workers() -> None:
    cores = machine_cores()
    assert local_engine.shares(1) == (1, cores)
    assert local_engine.shares(cores) == (cores, 1)
    assert local_engine.shares(4 * cores) == (4 * cores, 1)  # never below one core
    assert local_engine.shares(2, worker_cores=3) == (2, 3)  # data.worker_cores wins
