"""Sharding on a real dask.distributed cluster (a LocalCluster of worker processes), through the
``shard-corpus`` flow: its index is bit-identical to the local engine's, and a worker SIGKILLed
in the middle of a unit costs that unit only - the index equals a fault-free run's."""

from __future__ import annotations

import gzip
import json
import os
import signal
import sysconfig
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from megatrain.config import DataConfig

pytestmark = pytest.mark.slow  # a Dask cluster and a Prefect flow: part of make test, not make check

SEQ_LEN, VOCAB = 64, 1024


def _corpus(root: Path, modules: int, recursive: bool = False) -> tuple[list[str], str]:
    """Six gzip JSONL files of the standard library's text (a unit each, with data.unit_bytes
    below their size: compressed files are never cut) and a tokenizer.json, so no run trains one."""
    from megatrain.data.tokenizer import train_bpe

    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    stdlib = sorted(stdlib_dir.rglob("*.py") if recursive else stdlib_dir.glob("*.py"))[:modules]
    texts = [p.read_text(errors="replace") for p in stdlib]
    files = []
    for f in range(6):
        path = root / f"part-{f}.jsonl.gz"
        with gzip.open(path, "wt") as handle:
            for text in texts[f::6]:
                handle.write(json.dumps({"text": text}) + "\n")
        files.append(str(path))
    (root / "tokenizer.json").write_text(train_bpe(texts[:20], VOCAB, "<|endoftext|>").json_text)
    return files, str(root / "tokenizer.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], str]:
    return _corpus(tmp_path_factory.mktemp("dask-corpus"), 120)


@pytest.fixture(scope="module")
def long_units(tmp_path_factory) -> tuple[list[str], str]:
    """The same with four times the text a unit: a unit lasts long enough to be caught midway
    (the workers start in about a second, and a small unit was done before the test looked)."""
    return _corpus(tmp_path_factory.mktemp("dask-long-units"), 480, recursive=True)


def config(corpus, shard_url: Path, engine: str) -> dict:
    files, tokenizer = corpus
    return DataConfig(sources=files, tokenizer=tokenizer, shard_url=str(shard_url), engine=engine, num_workers=2,
                      samples_per_shard=16, val_fraction=0.05, unit_bytes=1 << 16).model_dump(mode="json")


def index_bytes(url: str) -> bytes:
    return (Path(url) / "index.json").read_bytes()


def test_dask_writes_the_local_engines_index_bit_for_bit(prefect_api, corpus, tmp_path, capfd):
    from flows.shard_data import shard_corpus_on_dask
    from megatrain.data.shard import shard_corpus

    local = shard_corpus(DataConfig.model_validate(config(corpus, tmp_path / "local", "local")), SEQ_LEN, VOCAB)
    capfd.readouterr()
    since = datetime.now(timezone.utc)  # the session's server also holds other tests' task runs
    dask = shard_corpus_on_dask(config(corpus, tmp_path / "dask", "dask"), SEQ_LEN, VOCAB)
    console = "".join(capfd.readouterr())
    # Dask's own lines go to its log file, not the console; its workers start no Prefect server of
    # their own: their task runs are recorded by the flow's server, where the UI looks
    assert "| distributed." not in console and "dask -" not in console, console
    assert "Starting temporary server" not in console, console
    assert (tmp_path / "dask" / "dask.log").exists()
    deadline = time.monotonic() + 30  # the workers' task-run records reach the server asynchronously
    while len(_task_runs_named("shard-unit", since)) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(_task_runs_named("shard-unit", since)) == 6
    assert dask["version"] == local.version and dask["num_samples"] == local.num_samples
    assert index_bytes(dask["url"]) == index_bytes(local.url)
    assert len(list((Path(dask["url"]) / "units").iterdir())) == 6
    # a second run finds the complete version: no unit runs again
    again = shard_corpus_on_dask(config(corpus, tmp_path / "dask", "dask"), SEQ_LEN, VOCAB)
    assert again == dask


def _task_runs_named(prefix: str, since: datetime) -> list:
    """The task runs named ``prefix...`` that the server recorded since ``since``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=prefix)))
    return [run for run in runs if run.name.startswith(prefix) and run.created and run.created >= since]


_CPU_TICKS: dict[int, int] = {}


def _busy(pids: list[int]) -> list[int]:
    """Those of ``pids`` whose CPU time grew since the last call (a worker running a task)."""
    busy = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if ticks - _CPU_TICKS.get(pid, ticks) >= 2:
            busy.append(pid)
        _CPU_TICKS[pid] = ticks
    return busy


def _dask_workers() -> list[int]:
    """PIDs of this test's Dask worker processes (spawned by the LocalCluster's nannies, which
    live in this process)."""
    me, found = os.getpid(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
            status = (proc / "status").read_text()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if "spawn_main" in cmdline and _descends_from(ppid, me):
            found.append(int(proc.name))
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False


def test_a_worker_killed_mid_unit_costs_that_unit_only(prefect_api, long_units, tmp_path):
    from flows.shard_data import shard_corpus_on_dask
    from megatrain.data.shard import shard_corpus

    reference = shard_corpus(DataConfig.model_validate(config(long_units, tmp_path / "reference", "local")), SEQ_LEN, VOCAB)
    result: dict = {}
    run = threading.Thread(target=lambda: result.update(
        summary=shard_corpus_on_dask(config(long_units, tmp_path / "killed", "dask"), SEQ_LEN, VOCAB)))
    run.start()
    units = tmp_path / "killed" / reference.version / "units"
    killed, deadline = None, time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and run.is_alive():
        # A unit writes its shards only after tokenizing its documents, then its unit.json: the
        # window in which one has shards but no unit.json is too short to catch on a busy machine.
        # Once the first unit has written and at most 3 of the 6 are done, at least 3 are left
        # for 2 workers: the one that spent CPU since the last look is in the middle of one.
        done = len(list(units.glob("*/unit.json"))) if units.exists() else 0
        busy = _busy(_dask_workers())
        if units.exists() and done <= 3 and busy:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)
            break
        time.sleep(0.05)
    run.join(600)
    assert killed is not None, "never caught a worker in the middle of a unit"
    assert not run.is_alive() and "summary" in result, "the flow did not finish after the worker was killed"
    assert index_bytes(result["summary"]["url"]) == index_bytes(reference.url)
    assert not Path(f"/proc/{killed}").exists() or killed not in _dask_workers()
