"""A warm standby process imports in the CPU time the training ranks leave idle (SCHED_IDLE), and
trains at normal priority once it is a rank; without the right to come back it never leaves
normal scheduling (``megatrain/training/standby.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


PRIORITY_PROBE = """
import json, os
from megatrain.training.standby import lower_priority, may_raise_priority
may = may_raise_priority()
back = lower_priority()
during = [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)]
back()
print(json.dumps([may, during, [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)]]))
"""


def _probe_priority(*prefix: str) -> tuple[bool, list[int], list[int]]:
    """(may raise its priority, [policy, niceness] while importing, [...] after the hand-over) of
    a fresh process, started under ``prefix`` (e.g. setpriv dropping a capability)."""
    import subprocess
    import sys

    done = subprocess.run([*prefix, sys.executable, "-c", PRIORITY_PROBE], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return tuple(json.loads(done.stdout))


def test_a_standby_imports_in_idle_cpu_time_and_trains_at_normal_priority() -> None:
    may, during, after = _probe_priority()
    base = [os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0)]
    if may:  # this machine lets a process raise its priority back: the imports take only idle CPU
        assert during == [os.SCHED_IDLE, base[1]] and after == base
    else:  # it could not leave SCHED_IDLE again: niceness +10 for the imports
        assert during == [os.SCHED_OTHER, min(19, base[1] + 10)]


def test_a_standby_without_the_right_to_raise_its_priority_never_enters_sched_idle() -> None:
    """Stuck in SCHED_IDLE a rank would train on the CPU time nobody else wants: without
    CAP_SYS_NICE (and with RLIMIT_NICE 0) the standby takes niceness +10 instead."""
    import shutil

    assert shutil.which("setpriv"), "util-linux's setpriv drops the capability for this test"
    may, during, after = _probe_priority("setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice",
                                         "prlimit", "--nice=0", "--")
    assert not may
    assert during[0] == os.SCHED_OTHER and during[1] >= 10 and after[0] == os.SCHED_OTHER
