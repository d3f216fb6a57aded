"""AttemptLog: every line of an attempt in files, only the meaningful ones forwarded. Fed by the
real launcher (``run_ranks``) running a real torchrun job whose rank 1 dies, so the lines are
torch's and Python's own (warnings, tracebacks, torchrun's failure report)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from megatrain.launch.ranks import free_port, run_ranks
from megatrain.observe.attempt_log import AttemptLog, read_attempts

RANK_SCRIPT = textwrap.dedent("""\
    import os, sys, warnings
    import torch.distributed as dist
    dist.init_process_group("gloo")  # as a rank does: torch then prefixes an uncaught exception's lines with [rankN]:
    rank = dist.get_rank()
    warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning)
    print(f"2026-01-01 00:00:00,000 [rank {rank}] INFO megatrain: step 1/4  loss 7.0", flush=True)
    print("[2026-01-01 00:00:00,000] [WARNING] [engine.py:1:x] **** You are using ZeRO with an untested optimizer, proceed with caution *****", flush=True)
    if rank == 1:
        raise ValueError("rank 1 broke at step 2")
""")


@pytest.mark.slow
def test_a_failed_attempt_is_whole_in_files_and_one_line_per_fault_on_the_console(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    forwarded: list[str] = []
    log = AttemptLog(tmp_path / "run", attempt=3, forward=forwarded.append)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script)]  # torchrun_command's flags
    result = run_ranks(command, on_line=log, timeout_s=120, poll_s=0.2)
    log.close({"status": result.status, "message": result.message, "wall_s": result.wall_s})
    assert result.status != "completed"

    everything = log.path.read_text()
    assert "Traceback (most recent call last)" in everything and "rank 1 broke at step 2" in everything
    assert "untested optimizer" in everything and "FutureWarning" in everything  # files keep the noise
    assert "rank 1 broke at step 2" in log.rank_path(1).read_text()

    shown = "\n".join(forwarded)
    assert "untested optimizer" not in shown and "FutureWarning" not in shown
    assert "Traceback" not in shown and 'File "' not in shown and "=====" not in shown
    tracebacks = [line for line in forwarded if "traceback in" in line]
    assert tracebacks == [f"rank 1: ValueError (traceback in {log.rank_path(1)})"]
    assert any("[rank 0] INFO megatrain: step 1/4" in line for line in forwarded)

    (attempt,) = read_attempts(tmp_path / "run")
    assert attempt["attempt"] == 3 and attempt["status"] == result.status and attempt["log"] == str(log.path)


def test_the_next_attempt_numbers_on_from_every_attempt_the_run_dir_saw(tmp_path):
    from megatrain.observe.attempt_log import next_attempt

    assert next_attempt(tmp_path / "new") == 1
    first = AttemptLog(tmp_path, attempt=1, forward=lambda line: None)
    first("step 1/4")
    first.close({"status": "stopped", "message": "stopped (SIGINT)"})
    assert next_attempt(tmp_path) == 2  # a rerun of the stopped campaign: its own log file
    AttemptLog(tmp_path, attempt=2, forward=lambda line: None)("step 2/4")  # killed: a log, no row
    (tmp_path / "logs" / "attempt-2.rank1.log").write_text("x\n")
    (tmp_path / "logs" / "attempt-x.log").write_text("not an attempt\n")
    assert next_attempt(tmp_path) == 3
    assert (tmp_path / "logs" / "attempt-1.log").read_text() == "step 1/4\n"
