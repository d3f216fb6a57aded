"""No secret leaks: a campaign run with planted secret values in the environment (storage keys, the
Redis password its real Redis runs with, tokens) leaves none of them in any file under the
campaign dir, in any artifact or in any log line read back from the Prefect API.

The ranks are made to print the secrets (a ``sitecustomize`` every child Python runs, as a chatty
library printing its credentials would), so the redaction is really exercised. Beside the secrets
they print a marker that is no secret: it must be found in the same places, which shows that the
search looks where the secrets would have gone (the test can fail)."""

from __future__ import annotations

import shutil
import socket
import uuid
from pathlib import Path

import pytest
from fault_matrix_common import run_campaign, write_campaign

SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "MEGATRAIN_REDIS_PASSWORD",
                    "HF_TOKEN", "SERVICE_DB_PASSWORD")
MARKER_VARIABLE = "MEGATRAIN_LEAK_MARKER"  # no secret's name: printed, kept, found


def _hits(text: str, values: dict[str, str]) -> list[str]:
    return [name for name, value in values.items() if value in text]


@pytest.mark.slow
def test_planted_secrets_reach_no_file_artifact_or_log(prefect_api, tmp_path, shard_root, monkeypatch) -> None:
    from prefect.client.orchestration import get_client

    from megatrain.reliability.redis_server import start_redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    planted = {name: f"planted-{name.lower()}-{uuid.uuid4().hex}" for name in SECRET_VARIABLES}
    marker = f"marker-{uuid.uuid4().hex}"
    for name, value in {**planted, MARKER_VARIABLE: marker}.items():
        monkeypatch.setenv(name, value)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"print('chatty library: creds', *[os.environ.get(n) for n in {SECRET_VARIABLES!r}], "
        f"'marker', os.environ.get({MARKER_VARIABLE!r}), file=sys.stderr, flush=True)\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{Path.cwd()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    redis = start_redis_server(port, password=planted["MEGATRAIN_REDIS_PASSWORD"])
    try:
        path = write_campaign(tmp_path, "leak", shard_url=shard_root,
                              # fresh rank interpreters, which run the chatty sitecustomize (forked ones start
                              # past it; their lines pass the same redaction in the launcher)
                              overrides=[f"reliability.redis_url=redis://127.0.0.1:{port}/0",
                                         "reliability.fork_cpu_ranks=false"])
        outcome = run_campaign(path)
    finally:
        redis.terminate()
        redis.wait(timeout=10)
    assert outcome.stage["attempts"] == 1

    campaign_dir = tmp_path / "campaigns" / "leak"
    leaks, marker_files = [], []
    for file in sorted(p for p in campaign_dir.rglob("*") if p.is_file()):
        text = file.read_bytes().decode("utf-8", errors="replace")
        leaks += [f"{file.relative_to(campaign_dir)}: {name}" for name in _hits(text, planted)]
        marker_files += [file.name] if marker in text else []
    with get_client(sync_client=True) as client:  # every page: the server holds other tests' runs too
        artifacts = _every_page(client.read_artifacts)
        logs = _every_page(client.read_logs)
    for artifact in artifacts:
        leaks += [f"artifact {artifact.key or artifact.id}: {name}"
                  for name in _hits(f"{artifact.data} {artifact.description}", planted)]
    leaks += [f"Prefect log: {name}" for log in logs for name in _hits(log.message, planted)]

    assert leaks == [], leaks
    # the ranks did print, and the search saw it: the marker is in the attempt's log files and the Prefect log
    assert any(name.startswith("attempt-1") for name in marker_files), marker_files
    assert any(marker in log.message for log in logs)
    assert artifacts, "no artifact read back"
    assert any(log.message.startswith("chatty library: creds ***") for log in logs)


def _every_page(read, page: int = 200) -> list:
    """All the rows a Prefect read endpoint has (one call returns at most a page)."""
    rows: list = []
    while True:
        found = read(limit=page, offset=len(rows))
        rows += found
        if len(found) < page:
            return rows
