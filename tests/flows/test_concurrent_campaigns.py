"""Two command-line campaigns on one machine at once (``python -m flows.pretrain c.yaml id=a`` and
``... id=b``): each run's temporary Prefect server keeps its state apart, so neither meets the
other's SQLite database ("database is locked") and both end Completed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from test_fault_matrix_lifecycle import FlowProcess

ROOT = Path(__file__).resolve().parents[2]


def tiny_campaign(directory: Path, shard_root: Path) -> Path:
    """One stage of two steps on one rank, nothing after it (no samples, no export)."""
    doc = {
        "id": "base", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 1,
        "root_dir": str(directory / "campaigns"), "shard_url": str(shard_root), "self_check": False,
        "samples": 0, "export": False,
        "overrides": ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2"],
        "stages": [{"name": "only", "steps": 2}],
    }
    path = directory / "campaign.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.slow
def test_two_campaigns_at_once_each_run_their_own_temporary_server(tmp_path, shard_root, monkeypatch):
    # an operator who configured no Prefect: no API URL, no PREFECT_HOME, a home of their own
    # (where Prefect's default state would be: it must stay without a database)
    home = tmp_path / "home"
    home.mkdir()
    for name in ("PREFECT_API_URL", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    path = tiny_campaign(tmp_path, shard_root)
    shard_in_process(path)  # the corpus sharded once for both: their shard-data tasks find it done
    runs = [FlowProcess(path, None, tmp_path / f"{cid}.log", args=[f"id={cid}"]) for cid in ("a", "b")]
    try:
        codes = [run.wait(600) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for run, code in zip(runs, codes):
        assert code == 0, run.output[-3000:]
        assert "database is locked" not in run.output and "Traceback" not in run.output, run.output[-3000:]
        assert "campaign " in run.output and "finished" in run.output
    for cid in ("a", "b"):
        assert (tmp_path / "campaigns" / cid / "report" / "report.md").exists()
    assert not (home / ".prefect" / "prefect.db").exists()  # each run's server kept its own state
    for run in runs:  # and removed it after the run
        assert not list(Path(tempfile.gettempdir()).glob(f"megatrain-prefect-run-{socket.gethostname()}-{run.proc.pid}-*"))


def shard_in_process(path: Path) -> None:
    """What the campaign's shard-data task does for its one stage (flows/shard_data.py), here,
    without a flow or a Prefect server."""
    from megatrain.config.campaign import load_campaign, stage_config
    from megatrain.data.shard import shard_components

    cfg = stage_config(load_campaign(path), 0)
    shard_components(cfg.data, cfg.seq_len, cfg.model.vocab_size)


def server_environment(tmp_path: Path, **env: str) -> dict:
    """``_server_environment()`` in a fresh process (Prefect reads its settings once) with only
    ``env`` of the Prefect settings set; the temp dir is ``tmp_path``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    clean.update(HOME=str(tmp_path), TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT), **env)
    code = "import json\nfrom flows.lifecycle import _server_environment\nprint(json.dumps(_server_environment()))"
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_temporary_servers_state_is_the_runs_own_unless_the_user_chose_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = f"megatrain-prefect-run-{socket.gethostname()}-"
    left = tmp_path / f"{prefix}{dead.pid}-abc"  # a run killed before it could remove its folder
    left.mkdir()
    own = server_environment(tmp_path)
    assert own["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert Path(own["PREFECT_HOME"]).parent == tmp_path and Path(own["PREFECT_HOME"]).name.startswith(prefix)
    assert not left.exists()
    chosen = {"PREFECT_HOME": str(tmp_path / "mine"), "PREFECT_SERVER_ANALYTICS_ENABLED": "true"}
    assert server_environment(tmp_path, **chosen) == {}
    url = f"sqlite+aiosqlite:///{tmp_path / 'mine.db'}"
    assert "PREFECT_HOME" not in server_environment(tmp_path, PREFECT_SERVER_DATABASE_CONNECTION_URL=url)
