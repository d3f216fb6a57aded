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
                    item.add_marker(pytest.mark.skip(reason="needs CUDA (make test-gpu on a machine with a GPU)"))
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


# ---------------------------------------------------------------------------------------------
# Nothing a test starts outlives it: a thread or a process left running goes on drawing from the
# process's random generators, holding ports and files and taking CPU from the tests after it,
# which then fail for no reason of their own (a fresh clone's make test did, twice).

LEFTOVER_GRACE_S = 2.0  # for a thread or process already told to stop to finish on a loaded machine

# What outlives a test by design. Anything a module- or session-scoped fixture starts belongs to
# that fixture (the Prefect test server, redis-server, a shared keeper; ``pytest_fixture_setup``
# below records it). Besides those, started by the first test that needs them and kept for the
# process's lifetime:
# - multiprocessing's fork server and its resource tracker: megatrain/launch/forked.py forks CPU
#   ranks from one warm server per launcher (here: per test worker);
# - Prefect's client threads: one event loop thread for its sync API, the log and event workers;
SESSION_THREAD_PREFIXES = ("GlobalEventLoopThread", "APILogWorkerThread", "EventsWorkerThread")
# - the threads of module-level pools, (module, attribute): the keeper's hashing pool, and the
#   compile pool torch.compile keeps per process (``AsyncCompile.pool``, an lru_cache'd executor).
SESSION_POOLS = (("megatrain.checkpoint.keeper_wire", "_HASH_THREADS"),)

_FIXTURE_STARTED: dict[str, set] = {"threads": set(), "pids": set()}


def _session_processes() -> set[int]:
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid} | _FIXTURE_STARTED["pids"]


def _session_threads() -> set:
    import sys

    threads = set(_FIXTURE_STARTED["threads"])
    for module, attribute in SESSION_POOLS:
        pool = getattr(sys.modules.get(module), attribute, None)
        threads |= set(getattr(pool, "_threads", ()))
    compile_pools = getattr(sys.modules.get("torch._inductor.async_compile"), "AsyncCompile", None)
    if compile_pools is not None and compile_pools.pool.cache_info().currsize:
        threads |= set(compile_pools.pool()._threads)
    return threads


def _child_processes() -> dict[int, str]:
    """This process's running children (pid -> command line), from /proc (zombies excluded: an
    exited child that nobody waited for holds nothing)."""
    me, found = os.getpid(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) != me or fields[0] == b"Z":
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                found[int(entry.name)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """What a module- or session-scoped fixture starts lives as long as that fixture: it is not
    the leftover of the test that happened to need it first."""
    if fixturedef.scope == "function":
        yield
        return
    import threading

    threads, children = set(threading.enumerate()), set(_child_processes())
    yield
    _FIXTURE_STARTED["threads"] |= set(threading.enumerate()) - threads
    _FIXTURE_STARTED["pids"] |= set(_child_processes()) - children


def _leftovers(threads_before: set, children_before: dict[int, str]) -> tuple[list, dict[int, str]]:
    import threading

    session = _session_threads()
    threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive() and not t.daemon
               and t not in session and not t.name.startswith(SESSION_THREAD_PREFIXES)]
    session_pids = _session_processes()
    children = {pid: cmd for pid, cmd in _child_processes().items()
                if pid not in session_pids and pid not in children_before}
    return threads, children


@pytest.fixture(autouse=True)
def fail_on_leftovers():
    """Fails the test that leaves a non-daemon thread or a child process running (after
    ``LEFTOVER_GRACE_S``), naming them, and kills the children it left (by pid), so that the
    tests after it start clean."""
    import signal
    import threading
    import time

    threads_before, children_before = set(threading.enumerate()), _child_processes()
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    threads, children = _leftovers(threads_before, children_before)
    while (threads or children) and time.monotonic() < deadline:
        time.sleep(0.05)
        threads, children = _leftovers(threads_before, children_before)
    if not (threads or children):
        return
    for pid in children:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    what = [f"thread {t.name!r} (target {getattr(t, '_target', None)!r})" for t in threads]
    what += [f"child process {pid}: {cmd}" for pid, cmd in children.items()]
    pytest.fail("the test left running (join or stop what it starts):\n  " + "\n  ".join(what), pytrace=False)


# Environment a launch puts into this process for the run it starts (launch/run_token.py: the run's
# token, inherited by its ranks). Left behind, the next test's children signed their records with it
# and wrote them under its key namespace, where an unsigned reader never looked (a Redis watcher test
# waited 60 s for records, in the suite only).
PER_RUN_ENVIRONMENT = ("MEGATRAIN_RUN_TOKEN",)


@pytest.fixture(autouse=True)
def restore_per_run_environment():
    """Every test starts and ends with the per-run variables this process had before it."""
    before = {name: os.environ.get(name) for name in PER_RUN_ENVIRONMENT}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_sessionfinish(session, exitstatus):
    """No hosts cluster of this test run left at its end: fails the run (tests/leftover_clusters.py)."""
    import leftover_clusters

    leftover_clusters.check(session)


@pytest.fixture
def shared_dir():
    """A folder on the file system every host of a cluster shares (each host has a /tmp of its own,
    so not tmp_path): the hosts tests' run dirs and shards."""
    import shutil

    path = Path(tempfile.mkdtemp(prefix="megatrain-hosts-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
