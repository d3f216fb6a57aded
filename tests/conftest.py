"""Suite-wide settings: quiet, deterministic, CPU-only, and isolated from the user's Prefect."""

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="megatrain-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# An environment with PYTHONDONTWRITEBYTECODE (this project's sandboxes set it) makes each of the
# suite's several hundred fresh interpreters (torchrun ranks, flow processes, servers, CLIs)
# compile megatrain/, flows/ and tasks/ from source again: ~0.8 s of CPU each on 2 cores, a few
# minutes of the suite. The tests and the processes they start keep bytecode (in __pycache__,
# ignored by git and docker); nothing a test checks depends on it.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    import sys

    sys.dont_write_bytecode = False


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shard_root(tmp_path_factory):
    """One shard directory for the session: sharding is idempotent, so only the first run pays."""
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="session")
def shard_url(tmp_path_factory) -> str:
    """The tiny recipe's corpus (300 kB of source) sharded once per session, before any run starts:
    concurrent runs must not race to write the same shards."""
    from megatrain.config import load_config
    from megatrain.data.shard import shard_corpus

    root = Path(__file__).resolve().parents[1]
    url = str(tmp_path_factory.mktemp("tiny-shards"))
    cfg = load_config(root / "configs/tiny-cpu.yaml", ["data.max_source_bytes=300000", f"data.shard_url={url}"])
    shard_corpus(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    return url


def _shared_tmp(tmp_path_factory) -> Path:
    """The session's temp root that every xdist worker of this run shares (a worker's own basetemp
    is ``<root>/popen-gwN``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def prefect_db_template(tmp_path_factory) -> Path:
    """An empty Prefect SQLite database with every migration applied, built once per ``pytest`` run
    (by the first worker that needs it; the others wait for it) with Prefect's own command
    (``prefect server database upgrade``). Migrating a new database costs a server ~8-10 s of CPU
    on 2 cores, paid once here instead of by every server that starts on a fresh database; a copy
    (``seed_prefect_db``) is a database such a server would have made itself, each server still
    gets one of its own, and it still runs its start-up migration check (a no-op at head)."""
    import sys

    from filelock import FileLock

    shared = _shared_tmp(tmp_path_factory)
    template = shared / "prefect-migrated.db"
    with FileLock(str(shared / "prefect-migrated.lock")):
        if not template.exists():
            build = Path(tempfile.mkdtemp(prefix="prefect-template-", dir=shared))
            env = dict(os.environ, PREFECT_HOME=str(build), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                       PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{build / 'prefect.db'}")
            env.pop("PREFECT_API_URL", None)
            done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                                  env=env, capture_output=True, text=True, timeout=600, check=False)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            # one self-contained file (no -wal/-shm), under its name only once whole: a worker that
            # died mid-copy leaves no half database for the next one to take as built
            os.replace(seed_prefect_db(build / "prefect.db", build / "template.db"), template)
    return template


def seed_prefect_db(template: Path, db: Path) -> Path:
    """Copy the migrated ``template`` to ``db`` (SQLite's backup API: a consistent copy, WAL
    folded in) for a server to start on; returns ``db``."""
    import sqlite3

    db.parent.mkdir(parents=True, exist_ok=True)
    source, target = sqlite3.connect(template), sqlite3.connect(db)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    return db


@pytest.fixture(scope="session")
def seeded_prefect_db(prefect_db_template):
    """``seeded_prefect_db(path)``: a copy of the migrated template at ``path`` (e.g.
    ``$PREFECT_HOME/prefect.db``, where a server started with that home keeps its state)."""
    return lambda db: seed_prefect_db(prefect_db_template, Path(db))


@pytest.fixture(scope="session")
def prefect_api(prefect_db_template):
    """A real Prefect server (SQLite in a temp dir) for the flow and task tests, one per session,
    on a database of its own copied from the migrated template (Prefect's test harness, with its
    database folder made by us instead of its ``mkdtemp``)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing import utilities
    from prefect.testing.utilities import prefect_test_harness

    def seeded_mkdtemp(*args, **kwargs) -> str:
        folder = tempfile.mkdtemp(*args, **kwargs)
        seed_prefect_db(prefect_db_template, Path(folder) / "prefect-test.db")  # the harness's file name
        return folder

    real_mkdtemp, utilities.mkdtemp = utilities.mkdtemp, seeded_mkdtemp
    try:
        harness = prefect_test_harness(server_startup_timeout=120)
        harness.__enter__()
    finally:
        utilities.mkdtemp = real_mkdtemp
    try:
        yield PREFECT_API_URL.value()
    finally:
        harness.__exit__(None, None, None)


@pytest.fixture
def campaign_file(tmp_path, shard_root):
    """Writes a small campaign (the tiny recipe at one layer, every path under tmp_path) and
    returns its path: ``campaign_file("id", stages_yaml, nproc=1, extra_yaml="")``."""
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def write(campaign_id: str, stages: str, nproc: int = 1, extra: str = "") -> Path:
        path = tmp_path / f"{campaign_id}.yaml"
        path.write_text(
            textwrap.dedent(f"""\
                id: {campaign_id}
                recipe: {root / 'configs/tiny-cpu.yaml'}
                nproc_per_node: {nproc}
                root_dir: {tmp_path / 'campaigns'}
                shard_url: {shard_root}
                self_check: false
                overrides:
                  - model.n_layer=1
                  - data.max_source_bytes=400000
                  - checkpoint.interval=2
                  - reliability.heartbeat_interval_s=0.5
                  - reliability.heartbeat_timeout_s=60
                """) + textwrap.dedent(extra) + "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  ")
        )
        return path

    return write


# What each module's tests took in a full ``make test`` (seconds; the phases of 0.5 s and more, from
# MEGATRAIN_TEST_TIMES): only the order of the modules comes from it, never what runs. Stale
# numbers only make the order less good. To refresh after a full run with MEGATRAIN_TEST_TIMES=t.txt:
#   python -c "import collections,json,sys; s=collections.Counter(); [s.update({l.split('::')[0]: \
#   float(l.split()[-1])}) for l in open('t.txt')]; json.dump(dict(s.most_common()), sys.stdout, indent=1)" \
#   > tests/module_seconds.json     (each line is there twice under xdist; only the order matters)
MODULE_SECONDS_FILE = Path(__file__).with_name("module_seconds.json")


def pytest_configure(config):
    """xdist's ``--dist loadfile`` would otherwise reorder the modules by how many tests each has
    (``--loadscope-reorder``, its default), whatever order the collection gives them: the longest
    modules (one or two end-to-end tests each) then ran last, one worker still busy with them
    while the other had nothing left. The order below is kept instead."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA. The modules run longest first (``module_seconds.json``; a
    module not in it: first if it has multi-process or end-to-end tests (``slow``), else last):
    with ``make test``'s xdist workers (whole modules each, ``--dist loadfile``), the long ones
    start early and the many short ones fill the gaps at the end, so that the workers end
    together. The order inside a module stays as written."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():  # run directly (not through make test's -m): skipped, not failed
            interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's kernels on CPU tensors
            for item in gpu_items:
                if not (interpreting and item.get_closest_marker("interpreter")):
                    item.add_marker(pytest.mark.skip(reason="needs CUDA (run through the device tool)"))
    import json

    seconds = json.loads(MODULE_SECONDS_FILE.read_text()) if MODULE_SECONDS_FILE.exists() else {}
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def longest_first(item) -> float:
        module = item.nodeid.split("::")[0]
        if module in seconds:
            return -float(seconds[module])
        return -float("inf") if module in slow_modules else 0.0

    items.sort(key=longest_first)  # stable: a module's tests stay together and in their order


@contextlib.contextmanager
def _tmpfs(path, size: int | str, read_only: bool = False):
    """A real filesystem of ``size`` (bytes, or tmpfs's "16k") at ``path`` (``read_only``: mounted ro, writes get
    EROFS), unmounted after; skipped where this machine cannot mount one."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"{'ro,' if read_only else ''}size={size}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False,
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def mount_tmpfs():
    """``with mount_tmpfs(path, size, read_only=False) as disk:`` (read-only and small stores)."""
    return _tmpfs


def pytest_runtest_logreport(report):
    """With MEGATRAIN_TEST_TIMES=<file>, one line per test phase as it ends (``nodeid phase
    seconds``): where a suite's time goes, readable while it still runs or after a timeout."""
    path = os.environ.get("MEGATRAIN_TEST_TIMES")
    if path and report.duration >= 0.5:
        with open(path, "a") as out:
            out.write(f"{report.nodeid} {report.when} {report.duration:.2f}\n")
