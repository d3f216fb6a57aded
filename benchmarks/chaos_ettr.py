"""Effective training time ratio (ETTR) under chaos: a real campaign through the ``pretrain``
flow, with a random fault about every ``--every`` seconds, and where the lost time went.

    python benchmarks/chaos.py --ettr [--minutes 30] [--every 180] [--seed 0] [--out runs/chaos]

One stage of the tiny recipe on 2 gloo ranks, long enough for ``--minutes`` of fault-free
training (the step time is measured first by a short probe run), Redis for heartbeats and
rendezvous (a supervisor restarts it 1.5 s after it dies, as Kubernetes would), checkpoints every
``--ckpt-interval`` steps. Faults are drawn at random (kill_rank, hang_rank, nan_loss,
storage_outage, kill_redis; each kind once per five faults, in random order), at random times spread around one per ``--every`` seconds, turned
into steps with the probe's step time. The flow detects and recovers from each by itself.

ETTR = productive iterations x iteration time / wall time (MegaScale §6): productive iterations
are the steps of the final run (redone steps count once), the iteration time is the median step
time of the run's steps. Lost time, per interruption: detection + teardown (fault fired -> the
flow sees the attempt ended), between attempts (-> the next attempt is launched), restart overhead
(the next attempt's wall minus its step times: process start, imports, engine, restore), steps
redone (steps run again after restoring the last committed checkpoint). With the start-up records
of megatrain/startup.py the restart is split further (relaunch to the rank process start, time to
first step, its phases); an engine without them (the BEFORE run) is split where the step number
goes back. The rest: the flow start and sharding, the first attempt's start-up, steps slower than
the median (checkpoint staging, other jobs' load), the flow's wrap-up.

``--step-s`` fixes the step time that turns ``--minutes`` into steps (and fault times into fault
steps), so two runs with the same seed train the same steps under the same faults; ``--set``
adds recipe overrides (``reliability.warm_standby=true``). The run samples the machine's load.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill_rank", "hang_rank", "nan_loss", "storage_outage", "kill_redis")
BASE = ["train.device=cpu", "model.n_layer=1", "data.max_source_bytes=400000", "train.micro_batch_size=8",
        "train.global_batch_size=16", "train.log_interval=50", "reliability.heartbeat_interval_s=1",
        "reliability.heartbeat_timeout_s=15", "reliability.max_restarts=50", "reliability.max_rollbacks=50"]


class RestartingRedis:
    """redis-server that comes back 1.5 s after it dies, on the same port, with a pid file."""

    def __init__(self, directory: Path, delay_s: float = 1.5):
        from megatrain.reliability.redis_server import start_redis_server

        self._start = start_redis_server
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url, self.pidfile, self.delay_s = f"redis://127.0.0.1:{self.port}/0", directory / "redis.pid", delay_s
        self.restarts, self.stopped = 0, False
        self._spawn()
        threading.Thread(target=self._supervise, daemon=True).start()

    def _spawn(self) -> None:
        self.proc = self._start(self.port)
        self.pidfile.write_text(f"{self.proc.pid}\n")

    def _supervise(self) -> None:
        while not self.stopped:
            if self.proc.poll() is None:
                time.sleep(0.05)
                continue
            time.sleep(self.delay_s)
            if not self.stopped:
                self._spawn()
                self.restarts += 1

    def stop(self) -> None:
        self.stopped = True
        self.proc.kill()


def probe_step_time(out: Path) -> float:
    """Median step time of 2 ranks on this recipe (a short torchrun run, steps 3..12)."""
    run_dir = out / "probe"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(29000 + random.randrange(900)), "-m", "megatrain.train", "--config",
               "configs/tiny-cpu.yaml", *BASE, "train.steps=12", f"train.run_dir={run_dir}",
               f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable",
               "checkpoint.interval=1000"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > 2)


def plan_faults(rng: random.Random, minutes: float, every_s: float, step_s: float, pidfile: Path) -> list[dict]:
    """One fault per ``every_s`` on average: each at a uniform random time within its window."""
    faults, n = [], max(1, int(minutes * 60 // every_s))
    kinds: list[str] = []
    for i in range(n):
        at_s = (i + rng.uniform(0.2, 0.9)) * every_s
        if not kinds:  # each kind once per round of five, in random order
            kinds = rng.sample(KINDS, len(KINDS))
        kind = kinds.pop()
        fault = {"kind": kind, "step": max(3, int(at_s / step_s)), "rank": rng.randrange(2)}
        if kind == "nan_loss":
            fault["rank"] = 0
        if kind == "storage_outage":
            fault["duration_s"] = 20.0
        if kind == "kill_redis":
            fault["target"] = str(pidfile)
        faults.append(fault)
    return faults


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.created, record.getMessage()))
        except Exception:
            pass

    def find_all(self, pattern: str) -> list[tuple[float, re.Match]]:
        regex = re.compile(pattern)
        return [(t, m) for t, msg in list(self.records) if (m := regex.search(msg))]


def attempts_from_metrics(path: Path) -> list[dict]:
    """metrics.jsonl split at the rows that carry a start-up record (each attempt's first step):
    one {startup, rows} per attempt, in order. An engine that writes no start-up records (before
    megatrain/startup.py) is split where the step number goes back (each restart resumes at or
    before the step it died in); its attempts have ``startup`` None."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    attempts: list[dict] = []
    if any("startup" in row for row in rows):
        for row in rows:
            if "startup" in row:
                attempts.append({"startup": row["startup"], "rows": []})
            if attempts:
                attempts[-1]["rows"].append(row)
        return attempts
    for row in rows:
        if not attempts or row["step"] <= attempts[-1]["rows"][-1]["step"]:
            attempts.append({"startup": None, "rows": []})
        attempts[-1]["rows"].append(row)
    return attempts


def breakdown(attempts: list[dict], ends: list[tuple[float, str, float]], fired: list[tuple[float, str]],
              t_start: float, t_end: float) -> dict:
    """ETTR and the lost time by cause (see the module doc). ``ends``: (time, status, attempt wall
    s) per attempt, from the flow's "attempt N ended" lines.

    Each interruption is split two ways. From the start-up records (this engine): detection +
    teardown, relaunch (attempt ended -> rank process start), time to first step. From the attempt
    walls alone (any engine, so the BEFORE run too): detection + teardown, "between attempts"
    (attempt ended -> the next one launched, flow bookkeeping) and "restart overhead" (the next
    attempt's wall minus its step times and minus the detection of the fault that ended it:
    process start, imports, engine, restore, and the checkpoint commits inside the attempt)."""
    wall_s = t_end - t_start
    done: set[int] = set()
    redone_s, step_times = 0.0, []
    for attempt in attempts:
        attempt["steps_s"] = sum(row["step_time_s"] for row in attempt["rows"])
        for row in attempt["rows"]:
            if row["step"] in done:
                redone_s += row["step_time_s"]
            done.add(row["step"])
            step_times.append(row["step_time_s"])
    iteration_s = statistics.median(step_times)
    productive_s = len(done) * iteration_s
    records = all(a["startup"] is not None for a in attempts)

    def detection(i: int) -> float:  # fault fired -> attempt i ended (0 for a clean end)
        if i >= len(ends) or ends[i][1] == "completed":
            return 0.0
        before = [t for t, _ in fired if t <= ends[i][0] and (i == 0 or t > ends[i - 1][0])]
        return ends[i][0] - max(before) if before else 0.0

    lost = {"detection+teardown": 0.0, "between attempts": 0.0, "restart overhead": 0.0, "steps redone": redone_s}
    interruptions = []
    for i in range(min(len(ends), len(attempts)) - 1):
        t_attempt_end, status, _ = ends[i]
        nxt_end, _, nxt_wall = ends[i + 1]
        parts = {"detection+teardown": detection(i), "between attempts": nxt_end - nxt_wall - t_attempt_end,
                 "restart overhead": nxt_wall - attempts[i + 1]["steps_s"] - detection(i + 1)}
        for key, value in parts.items():
            lost[key] += value
        if records:
            start = attempts[i + 1]["startup"]
            parts["relaunch (to process start)"] = start["started_at"] - t_attempt_end
            parts["time to first step"] = start["first_step_at"] - start["started_at"]
        interruptions.append({"status": status, **{k: round(v, 2) for k, v in parts.items()}})
    lost["flow start, sharding, first launch"] = (ends[0][0] - ends[0][2] - t_start) if ends else 0.0
    lost["first attempt's start-up"] = (ends[0][2] - attempts[0]["steps_s"] - detection(0)) if ends else 0.0
    lost["flow wrap-up after the last attempt"] = t_end - ends[-1][0] if ends else 0.0
    # steps slower than the median (load from other jobs, checkpoint staging inside the step)
    lost["slow steps (above the median)"] = sum(step_times) - redone_s - productive_s
    lost["other"] = wall_s - productive_s - sum(lost.values())
    result = {"ettr": productive_s / wall_s, "wall_s": wall_s, "productive_steps": len(done),
              "iteration_s": iteration_s, "productive_s": productive_s, "lost_s": lost,
              "interruptions": interruptions, "startup_records": records}
    if records:
        restarts = [a["startup"] for a in attempts[1:]]
        result["restart_phases_s"] = [s["phases_s"] for s in restarts]
    return result


def engine_commit() -> str:
    """The commit of the megatrain that ran (PYTHONPATH picks it: the BEFORE run uses an old tree)."""
    import megatrain

    tree = Path(megatrain.__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{tree} @ {done.stdout.strip() or '?'}"


def run_ettr(args, out: Path) -> int:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="megatrain-prefect-"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    rng = random.Random(args.seed)
    step_s = args.step_s or probe_step_time(out)
    steps = int(args.minutes * 60 / step_s)
    redis = RestartingRedis(out)
    faults = plan_faults(rng, args.minutes, args.every, step_s, redis.pidfile)
    print(f"engine {engine_commit()}; step time {step_s:.3f} s/step -> {steps} steps for {args.minutes:g} min; faults: "
          + ", ".join(f"{f['kind']}@{f['step']}" for f in faults), flush=True)
    doc = {"id": f"ettr-{int(time.time())}", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": 2,
           "root_dir": str(out / "campaigns"), "self_check": False,
           "overrides": [*BASE, f"checkpoint.interval={args.ckpt_interval}", f"reliability.redis_url={redis.url}",
                         *args.set],
           "stages": [{"name": "chaos", "steps": steps, "overrides": ["reliability.faults=" + json.dumps(faults)]}]}
    path = out / "campaign.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))

    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    records = Records()
    logging.getLogger().addHandler(records)
    from flows.pretrain import pretrain
    from megatrain.campaign import load_campaign, stage_config

    loads: list[float] = []  # the machine's 1-minute load every 10 s: other jobs share its cores
    sampling = threading.Event()
    threading.Thread(target=lambda: [loads.append(os.getloadavg()[0]) for _ in iter(lambda: sampling.wait(10), True)],
                     daemon=True).start()
    start = time.time()
    try:
        report = pretrain(str(path))
    finally:
        redis.stop()
        sampling.set()
    t_end = time.time()
    wall_s = t_end - start
    run_dir = Path(stage_config(load_campaign(path), 0).train.run_dir)
    fired = sorted((m.stat().st_mtime, m.name) for m in (run_dir / "faults").glob("fired-*.json"))
    ends = [(t, m.group(2), float(m.group(3))) for t, m in records.find_all(r"attempt (\d+) ended: (\w+) after ([\d.]+) s")]
    result = breakdown(attempts_from_metrics(run_dir / "metrics.jsonl"), ends, fired, start, t_end)
    result.update(raw={"flow": [start, t_end], "attempt_ends": ends, "fired": fired},faults_planned=faults, faults_fired=[name for _, name in fired], redis_restarts=redis.restarts,
                  stage=report["stages"][0], minutes=args.minutes, every_s=args.every, probe_step_s=step_s,
                  load_avg=os.getloadavg(), engine=engine_commit(),
                  load_1min={"mean": statistics.mean(loads or [0.0]), "max": max(loads or [0.0]), "samples": loads},
                  cpus=os.cpu_count())
    print(f"\nETTR {100 * result['ettr']:.1f}% over {wall_s / 60:.1f} min: {result['productive_steps']} productive "
          f"steps x {result['iteration_s']:.3f} s; {len(fired)} faults fired ({', '.join(result['faults_fired'])}); "
          f"{len(result['interruptions'])} restarts/rollbacks; Redis restarted {redis.restarts}x")
    print(f"{'lost time':<48} {'s':>8} {'% of wall':>9}")
    for key, value in result["lost_s"].items():
        print(f"{key:<48} {value:>8.1f} {100 * value / wall_s:>8.1f}%")
    for phases in result.get("restart_phases_s", []):
        print("  restart start-up: " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    for i, row in enumerate(result["interruptions"], 1):
        print(f"  interruption {i} ({row['status']}): " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items() if k != "status"))
    print(f"({os.cpu_count()} CPU cores shared with other work: 1-minute load mean "
          f"{result['load_1min']['mean']:.1f}, max {result['load_1min']['max']:.1f} over the run)")
    (out / "ettr.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}/ettr.json")
    return 0
