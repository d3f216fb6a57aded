"""Self-check on this CPU box: every check runs (2 gloo processes for the all-reduce) and
passes the permissive defaults; an impossible floor fails the check and names the node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.reliability.selfcheck import SelfCheckReport, cli, run_node_checks


@pytest.mark.slow
def test_cli_passes_on_cpu(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    rc = cli([f"checkpoint.durable_url=file://{tmp_path}/ckpt", f"reliability.redis_url={redis_url}",
              "--node", "node-a", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert report["passed"] and report["failing_nodes"] == []
    checks = {c["name"]: c for c in report["nodes"][0]["checks"]}
    assert set(checks) == {"gemm", "memory_copy", "allreduce_x2", "storage", "redis_rtt"}
    assert all(c["value"] > 0 and c["passed"] for c in checks.values())
    assert not list((tmp_path / "ckpt" / "_selfcheck").iterdir())  # the test file is cleaned up
    assert "all nodes passed" in printed


def test_impossible_threshold_fails_the_node(tmp_path: Path) -> None:
    cfg = load_config(overrides=[
        "reliability.selfcheck.min_gemm_tflops=1e9",
        "reliability.selfcheck.nproc_per_node=1",  # the all-reduce is covered above
        "reliability.selfcheck.gemm_size=256",
        "reliability.redis_url=redis://127.0.0.1:1/0",  # nothing listens there
        f"checkpoint.durable_url={tmp_path}",
    ])
    bad = run_node_checks(cfg, node="node-b")
    assert bad.failing == ["gemm", "redis_rtt"]
    redis_check = next(c for c in bad.checks if c.name == "redis_rtt")
    assert redis_check.value is None and "ConnectionError" in redis_check.detail

    good = run_node_checks(load_config(overrides=[
        "reliability.selfcheck.nproc_per_node=1", f"checkpoint.durable_url={tmp_path}"]), node="node-a")
    report = SelfCheckReport.merge([SelfCheckReport([good]), SelfCheckReport([bad])])
    assert report.failing_nodes() == ["node-b"]
    again = SelfCheckReport.from_json(report.to_json())
    assert again.failing_nodes() == ["node-b"] and again.nodes[1].checks[0].threshold == 1e9
    assert "FAIL" in report.table() and "failing nodes: ['node-b']" in report.table()


def test_bad_config_exit_code(tmp_path: Path) -> None:
    assert cli(["reliability.selfcheck.min_gemm_tflops=-1"]) == 2
