"""Self-check on this CPU box: every check runs (2 gloo processes for the all-reduce) and
passes the permissive defaults; an impossible floor fails the check and names the node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.reliability.selfcheck import SelfCheckReport, cli, run_node_checks

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"


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
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [out]  # the test file is cleaned up
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


def test_storage_check_is_the_preflight_probe(tmp_path: Path) -> None:
    """The storage check writes through the preflight's probe: a durable store without room for
    two checkpoints, or one that refuses writes, fails the check naming the location and bytes."""
    import subprocess

    from megatrain.parallel.plan import checkpoint_size

    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], check=False,
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        base = ["reliability.selfcheck.nproc_per_node=1", "reliability.selfcheck.gemm_size=64",
                "reliability.selfcheck.copy_mb=1", "reliability.selfcheck.storage_mb=1"]
        fits = run_node_checks(load_config(TINY, [*base, f"checkpoint.durable_url={disk}/ckpt"]), node="n")
        assert fits.passed, fits.checks
        too_big = load_config(TINY, [*base, f"checkpoint.durable_url={disk}/ckpt", "model.n_layer=24"])
        two = 2 * checkpoint_size(too_big, cuda=True).total
        check = next(c for c in run_node_checks(too_big, node="n").checks if c.name == "storage")
        assert not check.passed and check.value is None
        assert check.detail.startswith(f"LocationTooSmall: checkpoint.durable_url {disk}/ckpt: too small for two "
                                       f"checkpoints (2 x {two // 2} bytes): needs {two} bytes"), check.detail
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        check = next(c for c in run_node_checks(load_config(TINY, [*base, f"checkpoint.durable_url={disk}/ckpt"]),
                                                node="n").checks if c.name == "storage")
        assert "LocationNotWritable" in check.detail and "Read-only file system" in check.detail
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
