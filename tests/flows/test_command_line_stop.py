"""Ctrl-C of a command-line campaign (``python -m flows.pretrain``, its temporary Prefect server):
the terminal's SIGINT reaches the whole foreground process group. The run stops its ranks,
commits what is staged and ends in seconds with a few lines and the command that resumes it;
the resumed run's attempt gets a log file of its own."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from fault_matrix_common import STEPS, measured_step_s, write_campaign
from numbers_agree import assert_numbers_agree
from test_fault_matrix_lifecycle import SLOWED, FlowProcess, committed_steps, wait_for

from megatrain.config.campaign import load_campaign

ROOT = Path(__file__).resolve().parents[2]
STOP_LIMIT_S = 15.0  # Ctrl-C to the exit on an idle machine; on a busy one plus two of the run's own steps
MAX_LINES = 15
# slowed ~30x in the first attempt only (once: its marker stays in the run dir), so that Ctrl-C
# lands mid-stage; the resumed attempt then trains its remaining steps at full speed
SLOWED_ONCE = [{**SLOWED[0], "once": True}]


@pytest.mark.slow
def test_ctrl_c_of_a_command_line_campaign_ends_in_seconds_and_says_how_to_resume(tmp_path, shard_root, monkeypatch,
                                                                                   seeded_prefect_db):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # a temporary server, as a user without Prefect gets
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    # the server's database there, migrated already (a copy of the session's template): the
    # temporary server still starts and stops with the run, without ~10 s of migrations first
    seeded_prefect_db(tmp_path / "prefect" / "prefect.db")
    # a folder with a space in its name, as a user's may be: the printed resume command quotes it
    (tmp_path / "my campaigns").mkdir()
    path = write_campaign(tmp_path / "my campaigns", "ctrl-c", shard_url=shard_root, faults=SLOWED_ONCE)
    campaign = load_campaign(path)
    durable, run_dir = campaign.stage_durable_url(0), campaign.stage_dir(0)
    flow = FlowProcess(path, None, tmp_path / "first.log")
    try:
        wait_for(lambda: 2 in committed_steps(durable), 300, "step 2 committed")
        printed = len(flow.output.splitlines())
        limit_s = STOP_LIMIT_S + 2 * measured_step_s(run_dir)  # the flow acts as slowly as its ranks step
        pressed, pressed_at = time.monotonic(), datetime.now().strftime("%H:%M:%S.%f")[:-3]
        os.killpg(flow.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: flow, server and all
        code = flow.wait(60)
        stopped_s = time.monotonic() - pressed
    finally:
        flow.kill()
    after = flow.output.splitlines()[printed:]
    assert code == 130, flow.output[-3000:]
    first_log = (run_dir / "logs" / "attempt-1.log").read_text()
    assert stopped_s < limit_s, (f"{stopped_s:.1f} s from Ctrl-C ({pressed_at}) to the exit (limit {limit_s:.1f} s):\n" + "\n".join(after)
                                      + "\nthe attempt's log ends:\n" + first_log[-3000:])
    assert len(after) <= MAX_LINES and "Traceback" not in flow.output, "\n".join(after)
    assert not any("ConnectError" in line or "Error logging to API" in line for line in after), "\n".join(after)
    last = after[-1]
    steps = committed_steps(durable)
    assert "stopped (SIGINT)" in last and f"resumes from {max(steps)}" in last and STEPS not in steps, last
    resume = shlex.split(last.split("Resume: ", 1)[1])
    # the interpreter that ran the flow, as typed from where it ran (.venv/bin/python), not a bare
    # "python" that a shell without the virtual environment finds elsewhere or not at all
    assert resume[1:3] == ["-m", "flows.pretrain"] and resume[0] != "python", last
    assert os.path.realpath(ROOT / resume[0]) == os.path.realpath(sys.executable), last

    # the printed command, as printed, resumes the campaign; its attempt writes a log of its own
    out = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert STEPS in committed_steps(durable)
    # one set of numbers: the printed summary, status, report.json and TensorBoard; the Ctrl-C is an
    # interrupt, and the resumed run's summary counts the attempt before it
    (numbers,) = assert_numbers_agree(campaign.campaign_dir, printed=out.stdout).values()
    assert (numbers["attempts"], numbers["interrupts"], numbers["faults"]) == (2, 1, 0), numbers
    assert (run_dir / "logs" / "attempt-1.log").read_text() == first_log  # nothing appended to it
    resumed = (run_dir / "logs" / "attempt-2.log").read_text()
    assert f"step {max(steps) + 1}/{STEPS}" in resumed and "step 1/" not in resumed
    print(f"Ctrl-C ({pressed_at}) to exit: {stopped_s:.1f} s, {len(after)} lines; committed {steps}; resumed to {STEPS}")
