"""Multi-GPU scaling of the real trainer: data, tensor and pipeline parallelism, each overlap on/off.

    python3 benchmarks/parallel.py --out results.json [--quick] [--only dp1,dp2,...] [--label COMMIT]
        [--tp-overlap-check] [--schedule 'tp2-sp-c2+tp2-sp-c1;dp1|dp1-gb32;dp2+dp2-nooverlap']
    python3 benchmarks/parallel.py --quick --schedule 4 --out results.json   # four GPUs: DP4 + 13B layouts
    python3 benchmarks/parallel.py --quick --schedule 8 --out results.json   # eight: DP8 + 13B TPxPPxDP
    python3 benchmarks/parallel.py --cpu --quick --out cpu.json  # the same on 2 CPU processes (gloo)
    python3 benchmarks/parallel.py --cpu --quick --schedule 4 --out cpu4.json  # 4 CPU processes, tiny "13B"
    python3 benchmarks/parallel.py --quick --schedule cp --out cp.json   # context parallelism at 16k, 2 GPUs (cp4: 4)

Every configuration is the real ``megatrain.training.trainer.Trainer`` on ``configs/gpt-1.3b.yaml`` (with
the overrides listed in ``parallel_configs.CONFIGS``) on real data, launched with torchrun::

    python3 -m torch.distributed.run --nproc-per-node N benchmarks/parallel.py --worker \
        --config configs/gpt-1.3b.yaml --work-dir W --variants '[{"name": ..., "overrides": [...]}]'

Before the first launch the shards are built once (``parallel_launch.shard_command``; with
``--tp-overlap-check`` tests/megatrain/parallel/bench_tp_overlap.py runs on the GPUs meanwhile);
the trainer then finds them by fingerprint. The exact torchrun command of each launch is printed
and stored in the JSON.

Measured results and the exact device commands: benchmarks/RESULTS.md ("Two H200s").
Test the script on CPU first: ``--cpu --quick`` (tiny recipe, gloo, 2 processes, ~6 minutes).

What a rank measures: ``parallel_worker.py``; what is reported and derived from it:
``parallel_report.py``; how the driver launches and times out torchrun worlds:
``parallel_launch.py``; the configurations and schedules: ``parallel_configs.py``.

The JSON is rewritten after every launch, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel_configs import (  # noqa: E402
    CONFIGS, CPU_CONFIG, CPU_DATA, GPU_CONFIG, GPU_DATA, LONG_CONTEXT_SCHEDULES, LONG_SEQ, SCHEDULE, SCHEDULES,
    parse_schedule,
)
from parallel_launch import child_env, finish_tp_overlap_check, run_step, shard_command, start_tp_overlap_check  # noqa: E402
from parallel_report import derived, machine_info, print_table, summarize  # noqa: E402
from parallel_worker import worker  # noqa: E402


def driver(args) -> int:
    started = time.monotonic()
    deadline = started + args.deadline
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine_info(args), "args": vars(args), "launches": [], "results": {}}

    def save() -> None:
        report["derived"] = derived(report["results"])
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))

    check = start_tp_overlap_check(args) if args.tp_overlap_check else None  # GPU work beside the CPU sharding
    command = shard_command(args)
    print("$ " + shlex.join(command), flush=True)
    t = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=child_env({}), capture_output=True, text=True)
    report["shard"] = {"command": shlex.join(command), "seconds": time.monotonic() - t, "rc": done.returncode,
                       "summary": done.stdout[-2000:]}
    print(done.stdout[-1500:], done.stderr[-3000:] if done.returncode else "", flush=True)
    if check is not None:
        report["tp_overlap_check"] = finish_tp_overlap_check(check)
    save()
    if done.returncode:
        return 1

    schedule = parse_schedule(SCHEDULES.get(args.schedule, args.schedule)) if args.schedule else SCHEDULE
    wanted = set(args.only.split(",")) if args.only else set(CONFIGS)
    unknown = (wanted | {n for step in schedule for names in step for n in names}) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations: {sorted(unknown)}; known: {list(CONFIGS)}")
    for step in schedule:
        launches = [tuple(n for n in names if n in wanted) for names in step]
        launches = [names for names in launches if names]
        if not launches:
            continue
        if deadline - time.monotonic() < args.min_launch_s:
            report["launches"].append({"names": [n for l in launches for n in l], "status": "skipped: deadline"})
            print(f"skipped (deadline): {launches}", flush=True)
            continue
        for record in run_step(launches, args, deadline):
            report["launches"].append(record)
            for name in record["names"]:
                summary = summarize(name, Path(args.work_dir))
                if summary is not None:
                    report["results"][name] = summary
        save()
        print_table(report["results"], report["derived"])
    report["wall_s"] = time.monotonic() - started
    save()
    print_table(report["results"], report["derived"])
    return 0 if all(r["status"] == "ok" for r in report["launches"]) else 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one torchrun rank (the driver starts these)")
    p.add_argument("--variants", help="worker: JSON list of {name, overrides}")
    p.add_argument("--config", default=None, help=f"recipe (default {GPU_CONFIG}, or {CPU_CONFIG} with --cpu)")
    p.add_argument("--work-dir", default="runs/bench/parallel")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--quick", action="store_true", help="fewer steps for throughput-only configurations")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--schedule", default=None, help="launch order instead of SCHEDULE: 'a+b;c|d' (parse_schedule), or 4 / 8 / cp / cp4 for SCHEDULE_4 / SCHEDULE_8 / the context-parallel ones")
    p.add_argument("--cpu", action="store_true", help="2 CPU processes, gloo, the tiny recipe (tests the script)")
    p.add_argument("--label", default=os.environ.get("MEGATRAIN_COMMIT", ""), help="what was measured (commit)")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole driver")
    p.add_argument("--launch-timeout", type=float, default=400.0)
    p.add_argument("--min-launch-s", type=float, default=45.0, help="start no launch with less time left")
    p.add_argument("--set", dest="extra", action="append", default=[], help="extra override for every run")
    p.add_argument("--tp-overlap-check", action="store_true",
                   help="first run tests/megatrain/parallel/bench_tp_overlap.py on 2 GPUs (beside the sharding)")
    p.add_argument("--tp-overlap-connections", default="1", help="its CUDA_DEVICE_MAX_CONNECTIONS ('unset' for none)")
    args = p.parse_args(argv)
    if args.config is None:
        args.config = CPU_CONFIG if args.cpu else GPU_CONFIG
    args.data = CPU_DATA if args.cpu else GPU_DATA
    if args.schedule in LONG_CONTEXT_SCHEDULES:  # every run and the shards at the long length
        args.data = [*args.data, f"model.seq_len={LONG_SEQ['cpu' if args.cpu else 'gpu']}"]
    cpu = ["train.device=cpu", "parallel.backend=gloo"] if args.cpu else []
    # one learning-rate schedule whatever train.steps is, so runs of 12 and 20 steps compare step by step
    # a hung collective ends the launch in minutes, not the default 10
    args.common = [*args.data, *cpu, "optim.decay_steps=20", "reliability.collective_timeout_s=180", *args.extra]
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.cpu else "4")  # every launch the same: torchrun sets 1 only for several ranks
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
