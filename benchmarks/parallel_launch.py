"""How ``benchmarks/parallel.py`` starts work: the shard command, one torchrun launch per schedule
entry (launches of one step side by side, one GPU each), each with its own log, environment
(``SAFE_ENV`` always, a configuration's own ``env``) and time limit, stopped as a process group;
and the optional TP overlap check on two GPUs beside the sharding.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from parallel_configs import BIG_CPU, CONFIGS, SAFE_ENV

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe_micro_batch(args) -> int:
    from megatrain.config import load_config

    return load_config(args.config, args.common).train.micro_batch_size


def launch_command(names: tuple[str, ...], nproc: int, args) -> list[str]:
    mb = recipe_micro_batch(args)
    def own(o: str) -> str:
        return (BIG_CPU.get(o, o) if args.cpu else o).format(mb=mb, mb2=2 * mb, mb4=4 * mb, mb8=8 * mb)

    variants = [{"name": n, "overrides": [*args.common,  # then the configuration's own, which win
                                          *(own(o) for o in CONFIGS[n].overrides),
                                          f"train.steps={CONFIGS[n].steps_for(args.quick)}"],
                 **({"dp_max_ctas": CONFIGS[n].dp_max_ctas} if CONFIGS[n].dp_max_ctas else {})} for n in names]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "benchmarks/parallel.py", "--worker", "--config", args.config, "--work-dir", args.work_dir,
        "--variants", json.dumps(variants),
    ]


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(proc: subprocess.Popen, handle, timeout: float, started: float) -> str:
    """Wait for a launch until ``timeout`` seconds after ``started``; stop it then. Its status."""
    status = "ok"
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        status = "timeout"
        _stop(proc)
    handle.close()
    if status == "ok" and proc.returncode:
        status = f"failed (exit {proc.returncode})"
    return status


def run_step(launches: list[tuple[str, ...]], args, deadline: float) -> list[dict]:
    """Start the launches of one schedule step at once, wait for all; returns launch records."""
    procs = []
    gpu = 0
    for names in launches:
        nprocs = {CONFIGS[n].nproc for n in names}
        envs = {json.dumps(CONFIGS[n].env, sort_keys=True) for n in names}
        assert len(nprocs) == 1 and len(envs) == 1, f"one launch needs one world size and one env: {names}"
        nproc = nprocs.pop()
        env = child_env(CONFIGS[names[0]].env)
        if not args.cpu and len(launches) > 1:  # side by side: one GPU each
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu + i) for i in range(nproc))
            gpu += nproc
        for name in names:
            shutil.rmtree(Path(args.work_dir) / name, ignore_errors=True)
        command = launch_command(names, nproc, args)
        shown = " ".join(f"{k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES", *CONFIGS[names[0]].env) if k in env)
        printable = (shown + " " if shown else "") + shlex.join(command)
        print(f"\n$ {printable}", flush=True)
        log_path = Path(args.work_dir) / f"launch-{'+'.join(names)}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = log_path.open("w")
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append((names, printable, proc, handle, log_path, time.monotonic()))
    records = []
    for names, printable, proc, handle, log_path, started in procs:
        timeout = max(1.0, min(args.launch_timeout, deadline - time.monotonic()))
        status = _wait(proc, handle, timeout, started)
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        if status != "ok":
            print(f"--- {'+'.join(names)}: {status}; log tail:\n" + "\n".join(tail), flush=True)
        records.append({"names": list(names), "command": printable, "status": status,
                        "wall_s": time.monotonic() - started, "log": str(log_path)})
    return records


def child_env(extra: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **SAFE_ENV, **extra)

    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def start_tp_overlap_check(args):
    """tests/megatrain/parallel/bench_tp_overlap.py on 2 GPUs (NCCL): TP correctness against the
    unsharded model in fp32, then one 4-layer 1.3B-shape forward + backward per overlap setting."""
    out = Path(args.work_dir) / "tp_overlap.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "tests/megatrain/parallel/bench_tp_overlap.py", "--out", str(out),
               *(["--check-only"] if args.cpu else [])]
    extra = {} if args.tp_overlap_connections == "unset" else {"CUDA_DEVICE_MAX_CONNECTIONS": args.tp_overlap_connections}
    env = child_env(extra)
    if args.tp_overlap_connections == "unset":
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    printable = " ".join(f"{k}={v}" for k, v in extra.items()) + " " + shlex.join(command)
    print(f"$ {printable.strip()}", flush=True)
    log_path = Path(args.work_dir) / "tp_overlap.log"
    handle = log_path.open("w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, handle, log_path, out, printable.strip(), time.monotonic()


def finish_tp_overlap_check(check, timeout: float = 240.0) -> dict:
    proc, handle, log_path, out, printable, started = check
    status = _wait(proc, handle, timeout, started)
    lines = [l for l in log_path.read_text(errors="replace").splitlines() if l.startswith(("tp=", "check", "time"))]
    print("\n".join(lines) if status == "ok" else f"tp overlap check {status}:\n" +
          "\n".join(log_path.read_text(errors="replace").splitlines()[-30:]), flush=True)
    record = {"command": printable, "status": status, "wall_s": time.monotonic() - started, "lines": lines}
    if out.exists():
        record["result"] = json.loads(out.read_text())
    return record


def shard_command(args) -> list[str]:
    return [sys.executable, "-m", "megatrain.cli", "shard", "--config", args.config, *args.data]
