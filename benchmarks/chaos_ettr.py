"""Effective training time ratio (ETTR) under chaos: a real campaign through the ``pretrain``
flow, with a random fault about every ``--every`` seconds, and where the lost time went.

    python benchmarks/chaos.py --ettr [--minutes 30] [--every 180] [--seed 0] [--out runs/chaos]

One stage of the tiny recipe on 2 gloo ranks (or ``--recipe`` on ``--nproc`` ranks: a GPU run), long enough for ``--minutes`` of fault-free
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
of megatrain/observe/startup.py the restart is split further (relaunch to the rank process start, time to
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

from megatrain.observe.log_records import TimedLogRecords

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill_rank", "hang_rank", "nan_loss", "storage_outage", "kill_redis")
RIDDEN_THROUGH = ("fired-storage_outage", "fired-kill_redis")  # faults no attempt ends for
TINY = "configs/tiny-cpu.yaml"  # the default recipe, shrunk by TINY_OVERRIDES to steps of ~0.07 s on 2 CPU ranks
TINY_OVERRIDES = ["train.device=cpu", "model.n_layer=1", "data.max_source_bytes=400000", "train.micro_batch_size=8",
                  "train.global_batch_size=16"]
BASE = ["train.log_interval=50", "reliability.heartbeat_interval_s=1", "reliability.heartbeat_timeout_s=15",
        "reliability.max_restarts=50", "reliability.max_rollbacks=50"]


def recipe_overrides(args) -> list[str]:
    """What every run of the harness adds to the recipe: the tiny recipe's shrinking, then BASE,
    then ``--set`` (e.g. a GPU run: ``--recipe configs/gpt-125m.yaml --nproc 1 --set train.device=cuda``)."""
    return [*(TINY_OVERRIDES if args.recipe == TINY else []), *BASE, *args.set]


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


class CpuSampler:
    """CPU seconds used on this machine by kind of process (ranks, the flow process, the Prefect
    server, Redis, anything else), from /proc every few seconds: who shared the cores with the
    ranks. A process that ends between two samples loses its last few seconds."""

    KINDS = (("megatrain.train", "ranks and standbys"), ("megatrain.training.standby", "ranks and standbys"),
             ("torch.distributed.run", "ranks and standbys"), ("uvicorn", "Prefect server"),
             ("redis-server", "Redis"))

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.by_kind: dict[str, float] = {}
        self.sample()
        self.by_kind = {}  # what ran before the campaign does not count

    def kind(self, pid: int, cmdline: str) -> str:
        if pid == os.getpid():
            return "the flow process (watcher, launches, upload tasks, logs)"
        return next((name for key, name in self.KINDS if key in cmdline), "everything else on the machine")

    def sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = (Path("/proc") / entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (Path("/proc") / entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            pid, used = int(entry), (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            kind = self.kind(pid, cmdline)
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + used - self.seen.get(pid, 0.0)
            self.seen[pid] = used

    def totals(self) -> dict[str, float]:
        self.sample()
        return {kind: round(seconds, 1) for kind, seconds in sorted(self.by_kind.items())}


def free_port() -> int:
    """A port nothing on this machine listens on now (a guess from a range could collide)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe_step_time(out: Path, args) -> float:
    """Median step time of the campaign's ranks on its recipe (a short torchrun run, steps 3..12)."""
    run_dir = out / "probe"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "megatrain.train", "--config",
               args.recipe, *recipe_overrides(args), "train.steps=12", f"train.run_dir={run_dir}",
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


def attempts_from_metrics(path: Path) -> list[dict]:
    """metrics.jsonl split at the rows that carry a start-up record (each attempt's first step):
    one {startup, rows} per attempt, in order. An engine that writes no start-up records (before
    megatrain/observe/startup.py) is split where the step number goes back (each restart resumes at or
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


def first_step_times(attempts: list[dict], launches: list[float], step_lines: list[tuple[float, int]],
                     ends: list[tuple[float, str, float]]) -> list[float]:
    """When each attempt ended its first step: from its start-up record, else (an engine without
    them) from rank 0's first "step N/M" log line after the launch, less the step times of the
    steps after the first up to N (checked against the records: within 0.2 s). An attempt too
    short for a progress line (a rollback a few steps after its start) ended its first step when
    it ended less its later steps' times (its teardown then counts as start-up, < 1 s)."""
    times = []
    for k, attempt in enumerate(attempts):
        if attempt["startup"] is not None:
            times.append(attempt["startup"]["first_step_at"])
            continue
        t_next = launches[k + 1] if k + 1 < len(launches) else float("inf")
        first = attempt["rows"][0]["step"]
        line = next(((t, n) for t, n in step_lines if launches[k] <= t < t_next), None)
        if line is None:
            times.append(ends[k][0] - sum(r["step_time_s"] for r in attempt["rows"][1:]))
            continue
        t_line, step = line
        times.append(t_line - sum(r["step_time_s"] for r in attempt["rows"] if first < r["step"] <= step))
    return times


def breakdown(attempts: list[dict], launches: list[float], ends: list[tuple[float, str, float]],
              fired: list[tuple[float, str]], step_lines: list[tuple[float, int]], t_start: float,
              t_end: float) -> dict:
    """ETTR and the lost time by cause (see the module doc). ``launches``: when each attempt was
    launched; ``ends``: (time, status, wall s) per attempt, from the flow's "attempt N ended"
    lines; ``step_lines``: (time, step) of rank 0's progress lines."""
    wall_s = t_end - t_start
    done: set[int] = set()
    redone_s, step_times = 0.0, []
    for attempt in attempts:
        for row in attempt["rows"]:
            if row["step"] in done:
                redone_s += row["step_time_s"]
            done.add(row["step"])
            step_times.append(row["step_time_s"])
    iteration_s = statistics.median(step_times)
    productive_s = len(done) * iteration_s
    first_at = first_step_times(attempts, launches, step_lines, ends)

    def detection(i: int) -> float:  # fault fired -> attempt i ended (0 for a clean end or a false alarm)
        if ends[i][1] == "completed":
            return 0.0
        # only a fault that ends an attempt: a storage outage or a Redis kill is ridden through, and an
        # attempt that then ends in a loss spike of its own was not waiting on it
        before = [t for t, name in fired if launches[i] <= t <= ends[i][0] and not name.startswith(RIDDEN_THROUGH)]
        return ends[i][0] - max(before) if before else 0.0

    lost = {"detection+teardown": 0.0, "between attempts": 0.0, "launch -> first step (restarts)": 0.0,
            "steps redone": redone_s}
    interruptions = []
    outside_s = 0.0  # in the loop, outside the step timer: checkpoint saves, logging, heartbeats
    for i, attempt in enumerate(attempts):
        after_first = sum(r["step_time_s"] for r in attempt["rows"][1:])
        outside_s += ends[i][0] - detection(i) - first_at[i] - after_first
        if i == 0:
            continue
        parts = {"detection+teardown": detection(i - 1), "between attempts": launches[i] - ends[i - 1][0],
                 "launch -> first step (restarts)": first_at[i] - launches[i]}
        for key, value in parts.items():
            lost[key] += value
        interruptions.append({"status": ends[i - 1][1], **{k: round(v, 2) for k, v in parts.items()}})
    lost["flow start, sharding, first launch"] = launches[0] - t_start
    lost["first attempt: launch -> first step"] = first_at[0] - launches[0]
    lost["loop outside the step timer (checkpoint saves, logging)"] = outside_s
    lost["flow wrap-up after the last attempt"] = t_end - ends[-1][0]
    # steps slower than the median (load from other jobs, checkpoint staging inside the step)
    lost["slow steps (above the median)"] = sum(step_times) - redone_s - productive_s
    lost["other"] = wall_s - productive_s - sum(lost.values())
    # the same with each productive step at its own measured time: a slow step is then not lost
    # time (the steps' spread on a shared machine is not a fault's cost), redone steps still are
    measured_s = sum(step_times) - redone_s
    result = {"ettr": productive_s / wall_s, "ettr_measured_steps": measured_s / wall_s,
              "wall_s": wall_s, "productive_steps": len(done),
              "iteration_s": iteration_s, "productive_s": productive_s, "lost_s": lost,
              "interruptions": interruptions, "startup_records": all(a["startup"] is not None for a in attempts)}
    if result["startup_records"]:
        result["restart_phases_s"] = [a["startup"]["phases_s"] for a in attempts[1:]]
    return result


ATTEMPT_LAUNCHED = r"attempt (\d+): \d+ ranks"
ATTEMPT_ENDED = r"attempt (\d+) ended: (\w+) after ([\d.]+) s"
STEP_LINE = r"\[rank 0\] INFO megatrain: step (\d+)/\d+"


def analyse(records: TimedLogRecords, run_dir: Path, t_start: float, t_end: float) -> dict:
    """The breakdown from the flow's log records and the run's files."""
    fired = sorted((m.stat().st_mtime, m.name) for m in (run_dir / "faults").glob("fired-*.json"))
    launches = [t for t, _ in records.find_all(ATTEMPT_LAUNCHED)]
    ends = [(t, m.group(2), float(m.group(3))) for t, m in records.find_all(ATTEMPT_ENDED)]
    step_lines = [(t, int(m.group(1))) for t, m in records.find_all(STEP_LINE)]
    result = breakdown(attempts_from_metrics(run_dir / "metrics.jsonl"), launches, ends, fired, step_lines,
                       t_start, t_end)
    result.update(raw={"flow": [t_start, t_end], "launches": launches, "attempt_ends": ends, "fired": fired},
                  faults_fired=[name for _, name in fired])
    return result


def records_from_console(path: Path, day: str) -> TimedLogRecords:
    """A run's console output (Prefect's "HH:MM:SS.mmm | LEVEL | ... - message" lines, UTC) as
    records, to analyse a run again with this module's breakdown."""
    import datetime

    records = TimedLogRecords()
    for line in path.read_text().splitlines():
        match = re.match(r"(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| .*? - (.*)$", line)
        if match:
            when = datetime.datetime.strptime(f"{day} {match.group(1)}", "%Y%m%d %H:%M:%S.%f")
            records.records.append((when.replace(tzinfo=datetime.timezone.utc).timestamp(), match.group(2)))
    return records


def print_result(result: dict, out: Path) -> None:
    wall_s = result["wall_s"]
    print(f"\nETTR {100 * result['ettr']:.1f}% over {wall_s / 60:.1f} min: {result['productive_steps']} productive "
          f"steps x {result['iteration_s']:.3f} s; {len(result['faults_fired'])} faults fired "
          f"({', '.join(result['faults_fired'])}); {len(result['interruptions'])} restarts/rollbacks")
    if "ettr_measured_steps" in result:
        print(f"(with each productive step at its measured time instead of the median: "
              f"{100 * result['ettr_measured_steps']:.1f}%)")
    print(f"{'lost time':<56} {'s':>8} {'% of wall':>9}")
    for key, value in result["lost_s"].items():
        print(f"{key:<56} {value:>8.1f} {100 * value / wall_s:>8.1f}%")
    for phases in result.get("restart_phases_s", []):
        print("  restart start-up: " + "  ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    for i, row in enumerate(result["interruptions"], 1):
        print(f"  interruption {i} ({row['status']}): " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items() if k != "status"))
    if "cpu_s" in result:
        print("CPU seconds over the run: " + ", ".join(f"{k} {v:.0f}" for k, v in result["cpu_s"].items()))
    if "load_1min" in result:
        print(f"({result['cpus']} CPU cores shared with other work: 1-minute load mean "
              f"{result['load_1min']['mean']:.1f}, max {result['load_1min']['max']:.1f} over the run)")
    (out / "ettr.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}/ettr.json")


def reanalyse(out: Path, console: Path) -> int:
    """``--reanalyse OUT --console LOG``: the breakdown of a finished run again, from its files and
    its console log (the start and end of the flow are kept in OUT/ettr.json)."""
    old = json.loads((out / "ettr.json").read_text())
    t_start, t_end = old["raw"]["flow"]
    records = records_from_console(console, out.name.split("-")[0])
    run_dir = next((out / "campaigns").glob("*/chaos"))
    result = analyse(records, run_dir, t_start, t_end)
    result.update({k: v for k, v in old.items() if k not in result and k not in ("restart_phases_s",)})
    print_result(result, out)
    return 0


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
    step_s = args.step_s or probe_step_time(out, args)
    steps = int(args.minutes * 60 / step_s)
    redis = RestartingRedis(out)
    faults = plan_faults(rng, args.minutes, args.every, step_s, redis.pidfile)
    print(f"engine {engine_commit()}; step time {step_s:.3f} s/step -> {steps} steps for {args.minutes:g} min; faults: "
          + ", ".join(f"{f['kind']}@{f['step']}" for f in faults), flush=True)
    doc = {"id": f"ettr-{int(time.time())}", "recipe": str(ROOT / args.recipe), "nproc_per_node": args.nproc,
           "root_dir": str(out / "campaigns"), "self_check": False,
           "overrides": [*recipe_overrides(args), f"checkpoint.interval={args.ckpt_interval}",
                         f"reliability.redis_url={redis.url}"],
           "stages": [{"name": "chaos", "steps": steps, "overrides": ["reliability.faults=" + json.dumps(faults)]}]}
    path = out / "campaign.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))

    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    records = TimedLogRecords()
    logging.getLogger().addHandler(records)
    from flows.pretrain import pretrain
    from megatrain.config.campaign import load_campaign, stage_config

    loads: list[float] = []  # the machine's 1-minute load every 10 s: other jobs share its cores
    sampling = threading.Event()
    cpu = CpuSampler()

    def sample() -> None:
        loads.append(os.getloadavg()[0])
        cpu.sample()

    threading.Thread(target=lambda: [sample() for _ in iter(lambda: sampling.wait(5), True)], daemon=True).start()
    start = time.time()
    try:
        report = pretrain(str(path))
    finally:
        redis.stop()
        sampling.set()
    t_end = time.time()
    cpu_s = {**cpu.totals(), "available (cores x wall)": (os.cpu_count() or 1) * (t_end - start)}
    run_facts = dict(raw={"flow": [start, t_end]}, faults_planned=faults, redis_restarts=redis.restarts,
                     minutes=args.minutes, every_s=args.every, probe_step_s=step_s, engine=engine_commit(),
                     cpus=os.cpu_count(), cpu_s=cpu_s,
                     load_1min={"mean": statistics.mean(loads or [0.0]), "max": max(loads or [0.0]), "samples": loads})
    (out / "ettr.json").write_text(json.dumps(run_facts, indent=2, default=str))  # --reanalyse can start from it
    result = analyse(records, Path(stage_config(load_campaign(path), 0).train.run_dir), start, t_end)
    result.update({k: v for k, v in run_facts.items() if k != "raw"}, stage=report["stages"][0])
    print_result(result, out)
    return 0
