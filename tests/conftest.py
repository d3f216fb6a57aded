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


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect server (SQLite in a temp dir) for the flow and task tests, one per session."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


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


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA. Modules with multi-process or end-to-end tests (``slow``) run
    first: with ``make test``'s two xdist workers (whole modules each, ``--dist loadfile``), the long
    ones start early and the many short ones fill the gaps at the end. The order inside a module
    stays as written."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():  # run directly (not through make test's -m): skipped, not failed
            interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's kernels on CPU tensors
            for item in gpu_items:
                if not (interpreting and item.get_closest_marker("interpreter")):
                    item.add_marker(pytest.mark.skip(reason="needs CUDA (run through the device tool)"))
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)


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
