"""The operator's commands answer without a server and without a traceback (the campaign-dir
paths of status/report/checkpoints are exercised on a real campaign in tests/scripts/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_flow_help_prints_usage_and_starts_no_server():
    result = run("-m", "flows.pretrain", "--help")
    assert result.returncode == 0 and "usage: python -m flows.pretrain" in result.stdout
    assert "id=my-run" in result.stdout and "--verbose" in result.stdout
    assert "temporary server" not in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_status_and_report_name_what_they_could_not_find(tmp_path):
    status = run("-m", "megatrain.cli", "status", "no-such-campaign", "--root", str(tmp_path))
    assert status.returncode == 1 and "no campaign of that id under" in status.stderr and not status.stdout
    report = run("-m", "megatrain.cli", "report", str(tmp_path))
    assert report.returncode == 2 and "neither a campaign dir" in report.stdout and not report.stderr
    listing = run("-m", "megatrain.cli", "--help").stdout
    assert "status" in listing and "report" in listing
