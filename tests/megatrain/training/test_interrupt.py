"""Ctrl-C of ``megatrain train``: one line with the last committed step and the command that
resumes it, exit 130, and that command resumes from there."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_ctrl_c_of_megatrain_train_is_one_line_with_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "megatrain.cli", "train", "--config", "configs/tiny-cpu.yaml",
               f"train.run_dir={run_dir}", "checkpoint.interval=2", "train.steps=100000", "model.n_layer=1",
               "data.max_source_bytes=400000", "train.log_interval=1",
               # the cosine's length fixed apart from train.steps: the resume below runs to step + 1 on the very
               # same LRs whichever step the interrupt lands at (a shortened cosine would be refused past warm-up)
               "optim.decay_steps=100000"]
    # Ctrl-C's default action, as in a terminal: a pytest-xdist worker ignores SIGINT, and an
    # ignored signal stays ignored across exec (Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _interrupt_and_resume(proc, command, run_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _interrupt_and_resume(proc: subprocess.Popen, command: list[str], run_dir: Path) -> None:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("committed checkpoint" in line and "step-00000004" in line for line in out):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(out)[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C (100,000 steps: it is still training)
    code = proc.wait(30)
    err = proc.stderr.read()
    assert code == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("megatrain train: interrupted; step ") and f"committed in {run_dir}/checkpoints" in line, line
    step = int(line.split("; step ", 1)[1].split()[0])
    assert step >= 4
    resume = shlex.split(line.split("; resume: ", 1)[1])
    assert resume[1] == "train" and resume[2:] == command[4:], line
    # the environment's own console script: found on PATH as that very file, or named by its path
    script = shutil.which(resume[0], path=os.environ.get("PATH")) if "/" not in resume[0] else str(ROOT / resume[0])
    assert Path(resume[0]).name == "megatrain" and script and \
        os.path.realpath(script) == os.path.realpath(Path(sys.executable).absolute().parent / "megatrain"), line
    resumed = subprocess.run([sys.executable, "-m", "megatrain.cli", *resume[1:], f"train.steps={step + 1}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step}" in resumed.stdout + resumed.stderr or f"step {step + 1}/" in resumed.stdout, \
        resumed.stdout[-3000:]
    assert "step 1/" not in resumed.stdout
