"""A warm standby process: import everything a rank needs, wait for a rank, become it.

The launcher side (``megatrain/launch/standby.py``) starts one of these per rank of the next
attempt, at the lowest CPU priority, and hands each its rank over stdin:

    python -m megatrain.training.standby   # imports, prints READY_LINE, then blocks reading one line
    {"env": {"RANK": "1", ...}, "argv": ["--config", ...], "handed_over_at": <time>}

It then runs ``megatrain.training.rank.main`` as that rank; its start-up timer counts from the
hand-over, so the breakdown shows what the restart itself cost.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from megatrain.launch.standby import READY_LINE, STANDBY_INDEX_ENV
from megatrain.observe.startup import HANDED_OVER_ENV  # the rank's start time, for its start-up breakdown

WARM_NICE = 10  # where SCHED_IDLE cannot be left again: the standby imports at this niceness
CAP_SYS_NICE = 23  # the capability bit that lets a process raise its own priority back


def warm_imports() -> None:
    """Everything a rank imports before its first step, including what first calls import."""
    import megatrain.training.rank  # noqa: F401  (config, errors, lease)
    import megatrain.training.trainer  # noqa: F401  (torch, DeepSpeed, the model, data, checkpoints)
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # Optimizer.__init__ imports torch._dynamo
    try:  # DeepSpeed's ZeRO optimizer check imports it (a DeepSpeed without Muon has nothing to warm)
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass
    if torch.cuda.is_available():  # a GPU rank: what its compiled first step imports, its GPU ready
        import torch._inductor.compile_fx  # noqa: F401  (Inductor, Triton: seconds a restart no longer waits)

        warm_gpu(int(os.environ.get(STANDBY_INDEX_ENV, "0")))


def warm_gpu(local_rank: int) -> None:
    """The CUDA context and a cuBLAS handle on the GPU this process will train on (process i of a
    standby set becomes local rank i, megatrain/launch/standby.py), made while the attempt before it
    trains: a few hundred MB of that GPU's memory, and the driver's part of a restart done."""
    import torch

    if local_rank >= torch.cuda.device_count():
        return
    torch.cuda.set_device(local_rank)
    probe = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    (probe @ probe).sum().item()


def may_raise_priority() -> bool:
    """Whether this process may give itself back a normal priority: CAP_SYS_NICE, or a
    RLIMIT_NICE that allows its niceness (the kernel's test for leaving SCHED_IDLE)."""
    import resource

    try:
        caps = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
        if int(caps.split()[1], 16) >> CAP_SYS_NICE & 1:
            return True
    except (OSError, StopIteration, ValueError):
        pass
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return limit == resource.RLIM_INFINITY or limit >= 20 - os.getpriority(os.PRIO_PROCESS, 0)


def lower_priority() -> Callable[[], None]:
    """Run this process in the CPU time nobody else wants; returns the call that undoes it.

    SCHED_IDLE takes no CPU from the training ranks (a niceness of +10 still takes ~10% of a
    busy core, and the imports cost the same CPU time either way). A process that could not
    leave SCHED_IDLE again would train starved, so without the right to raise its priority it
    takes niceness +10 instead, and stays there if it cannot go back."""
    if hasattr(os, "SCHED_IDLE") and may_raise_priority():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, min(19, base_nice + WARM_NICE))

    def back_to_base() -> None:
        try:  # allowed for root or with RLIMIT_NICE; else stay nice
            os.setpriority(os.PRIO_PROCESS, 0, base_nice)
        except PermissionError:
            print(f"megatrain: standby could not leave niceness {base_nice + WARM_NICE}", file=sys.stderr, flush=True)
    return back_to_base


def standby_main() -> int:
    """A standby process: import at low priority, wait for a rank, become it, and exit without
    the interpreter's teardown."""
    back_to_normal_priority = lower_priority()
    warm_imports()
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line.strip():  # the launcher closed the pool: nothing to run
        return 0
    order = json.loads(line)
    back_to_normal_priority()
    os.environ.update(order["env"])
    os.environ[HANDED_OVER_ENV] = str(order["handed_over_at"])
    from megatrain.training.rank import main

    code = main(order["argv"])
    # Every file is written and the lease released; what is left is the interpreter's teardown of
    # torch and DeepSpeed (3-6 s on a loaded CPU), which a restart after an anomaly waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(standby_main())
