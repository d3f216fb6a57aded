"""Measured ETTR of a campaign on a cluster of hosts on this machine: one long stage with a host fault
every few minutes of wall time, against the same campaign with no fault.

    sudo .venv/bin/python benchmarks/cluster_ettr.py [--minutes 20] [--every-minutes 4]
        [--rotation host_down,partition,slow_link,storage_host_down,redis_host_down]
        [--out benchmarks/results/cluster-ettr-20min-cpu-2026-12-04.json]
    .venv/bin/python benchmarks/cluster_ettr.py --report-from runs/cluster-ettr.json   # the report again

Each run is one stage on a fresh cluster (``megatrain/launch/hosts.py``: 4 node hosts x 1 CPU rank,
head, redis, storage), the tiny recipe as ``cluster_faults_runs.py`` configures it (durable store on
the cluster's S3, ``s3://megatrain/<run>``), launched through the host watch
(``python -m megatrain.reliability.host_watch``) with ``reliability.on_node_loss: shrink``, the
slow-link eviction on (``evict_slow_host_after_s``) and ``max_restarts`` high enough that every loss
gets its shrunk attempt. ``train.steps`` is set far past what the campaign can reach: a campaign is a
fixed length of WALL TIME, ``--minutes`` from the launch; at its end the benchmark stops the launcher
(SIGINT, SIGKILL after 5 s where it trains on; the cluster's teardown ends what ran in its hosts) and
counts the rows that appeared before the stop.

Faults are injected by wall time, not by step: at ``every, 2 x every, ...`` (strictly before the end)
after the launch, the benchmark itself fires the next class of ``--rotation`` through the launcher's
own injector class (``megatrain.launch.host_faults.HostFaults``, the cable the operator pulls; the
launcher is not told, it finds out from the heartbeats, the slow-link view, the store's outage). The
node classes go to different node hosts, never node 0 (rank 0, the committer), each to one not hit
before (3, 2, 1 in turn), so the stage can go on: ``host_down`` (the host killed, its link removed:
the next attempt runs shrunk on the survivors for the rest of the campaign, a capacity loss that
counts against ETTR as it would on a cluster that does not replace the host), ``partition`` for
``--partition-s`` (below ``heartbeat_timeout_s``: a cut the stage may ride out; if the watch calls
the host lost it shrinks as for a host_down), ``slow_link`` (tbf at ``--slow-rate``; evicted once the
slow-link view names it, then shrunk), ``storage_host_down`` / ``redis_host_down`` for
``--service-s`` (the services' outage paths; no capacity lost).

ETTR, precisely. For each run:

    ETTR = useful_steps x step_s / wall_s

- ``useful_steps``: the highest step any metrics row reached; steps trained again after a restore (rows
  of a step seen before) are not counted twice;
- ``step_s``: the FAULT-FREE run's steady step time (``cluster_faults.steady_step_s``: the median wall
  time between its consecutive rows after the first two; saves and logging included, start-up not);
- ``wall_s``: from the launch of the launcher to the campaign's end (the stop), the same ``--minutes``
  for both runs (what they actually got is in the JSON: ``wall_s``).

So ``useful_steps x step_s`` is the fault-free-equivalent productive time: how long the fault-free
run's steady pace takes for the steps this run got. The fault-free run's ETTR is below 1 by its
start-up and its save pauses; ``ettr_ratio`` = faulted / fault-free is what the faults cost. A shrunk
attempt's steps count as whole steps (the same global batch at more accumulation): if they are slower
the run reaches fewer steps, and that lowers its ETTR. On this 2-core machine the 4 ranks share two
cores, so fewer ranks need not mean slower steps until one rank is left; a real cluster's shrink loses
the host's compute outright. Said in the report, not corrected for.

Per fault, from the fault's marker (fired), the watch's verdicts (``host-lost.json`` of each attempt,
kept as they appear) and the rows of the window from the previous fault to the next one, the numbers of
``cluster_faults.measure``: time to detection, time to the first step after recovery, steps redone,
time lost against the steady pace (the fault-free run's). A partition no watch called a lost host is
recovered when its link is up again (its heal timer: the fault's time + ``duration_s``). The slow link's
detection is its eviction (named slow, then ``evict_slow_host_after_s`` more). Steps redone: rows of the
window whose step an earlier row had reached.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_faults import loss_differs_from, measure, steady_step_s  # noqa: E402

NODE_CLASSES = ("host_down", "partition", "slow_link")
SERVICE_CLASSES = ("storage_host_down", "redis_host_down")
ROTATION = ("host_down", "partition", "slow_link", "storage_host_down", "redis_host_down")
FAULT_NODES = (3, 2, 1)  # never node 0: rank 0 commits; each node class to a host not hit before
STOP_GRACE_S = 5.0  # the launcher does not always end on SIGINT; hosts.down then ends its hosts


def schedule(minutes: float, every_minutes: float, rotation: list[str] | tuple[str, ...] = ROTATION,
             partition_s: float = 2.0, service_s: float = 4.0, slow_rate: str = "20mbit",
             nodes: tuple[int, ...] = FAULT_NODES) -> list[dict]:
    """The faults of a campaign of ``minutes``: one at ``k x every`` seconds after the launch for
    k = 1, 2, ... while strictly before the end, the classes of ``rotation`` in turn (from the start
    again when it runs out). Node classes take ``nodes`` in turn (a host hit once is never hit again);
    a node class with no node left is skipped for the next service class. ``at_s``: seconds from the
    launch."""
    if minutes <= 0 or every_minutes <= 0:
        raise ValueError(f"minutes and every_minutes must be positive, got {minutes}, {every_minutes}")
    unknown = [c for c in rotation if c not in ROTATION]
    if unknown or not rotation:
        raise ValueError(f"unknown classes {unknown}; known: {', '.join(ROTATION)}")
    total, every = minutes * 60.0, every_minutes * 60.0
    times, k = [], 1
    while k * every < total - 1e-9:
        times.append(round(k * every, 3))
        k += 1
    free_nodes, out, turn = list(nodes), [], 0
    for at in times:
        for _ in range(len(rotation)):
            kind = rotation[turn % len(rotation)]
            turn += 1
            if kind in SERVICE_CLASSES:
                out.append({"at_s": at, "kind": kind, "node": 0, "duration_s": service_s})
                break
            if free_nodes:
                fault = {"at_s": at, "kind": kind, "node": free_nodes.pop(0)}
                if kind == "partition":
                    fault["duration_s"] = partition_s
                if kind == "slow_link":
                    fault["rate"] = slow_rate
                out.append(fault)
                break
        else:  # only node classes in the rotation and no node left: no fault at this time
            continue
    return out


def useful_steps(rows: list[tuple[float, dict]]) -> int:
    """The highest step reached: a step trained again after a restore is not counted twice."""
    return max((r["step"] for _, r in rows), default=0)


def steps_redone(rows: list[tuple[float, dict]]) -> int:
    """Rows of a step some earlier row had already reached (trained again after a restore)."""
    high, redone = 0, 0
    for _, r in sorted(rows, key=lambda item: item[0]):
        if r["step"] <= high:
            redone += 1
        high = max(high, r["step"])
    return redone


def ettr(rows: list[tuple[float, dict]], step_s: float, wall_s: float) -> dict:
    """``useful_steps x step_s / wall_s`` (the module's docstring defines each term)."""
    if wall_s <= 0 or not step_s > 0:
        raise ValueError(f"wall_s and step_s must be positive, got {wall_s}, {step_s}")
    useful = useful_steps(rows)
    productive = useful * step_s
    return {"useful_steps": useful, "rows": len(rows), "steps_redone": steps_redone(rows),
            "productive_s": round(productive, 2), "wall_s": round(wall_s, 2), "ettr": round(productive / wall_s, 4)}


def own_pace(rows: list[tuple[float, dict]], attempt_starts: list[float], wall_s: float) -> dict:
    """The same ratio with each attempt's own steady pace in place of the fault-free run's: the steps an
    attempt added past the highest step before it, times ``steady_step_s`` of its own rows, summed, over
    ``wall_s``. What the faults cost in time alone, the speed of a shrunk layout set aside (on this
    machine fewer ranks share two cores, and may step faster than four)."""
    starts = sorted(attempt_starts) or [min((t for t, _ in rows), default=0.0)]
    bounds = [*starts[1:], float("inf")]
    productive, high, paces = 0.0, 0, []
    for lo, hi in zip(starts, bounds):
        seg = [(t, r) for t, r in rows if lo <= t < hi]
        if not seg:
            paces.append(None)
            continue
        pace = steady_step_s(seg)
        added = max(0, useful_steps(seg) - high)
        high = max(high, useful_steps(seg))
        paces.append(round(pace, 4))
        productive += added * pace if pace == pace else 0.0  # nan: too few rows to know its pace
    return {"attempt_step_s": paces, "productive_s": round(productive, 2), "ettr": round(productive / wall_s, 4)}


def fault_windows(faults: list[dict], start: float, end: float) -> list[tuple[float, float]]:
    """For each fired fault (its marker's ``time``), the span of rows that are its own: from the
    previous fault's time (the launch for the first) to the next fault's (the end for the last)."""
    times = [f["time"] for f in faults]
    return [(times[i - 1] if i else start, times[i + 1] if i + 1 < len(times) else end) for i in range(len(times))]


def verdict_for(fault: dict, verdicts: list[dict], until: float) -> dict | None:
    """The first verdict found after ``fault`` fired and before ``until`` (the next fault)."""
    found = [v for v in verdicts if fault["time"] < v.get("detected_at", 0.0) <= until]
    return min(found, key=lambda v: v["detected_at"]) if found else None


def per_fault(run: dict, step_s: float) -> list[dict]:
    """``cluster_faults.measure`` for each fault of a faulted run, on its window's rows and verdict."""
    faults = sorted(run["faults"], key=lambda f: f["time"])
    out = []
    for fault, (lo, hi) in zip(faults, fault_windows(faults, run["start"], run["stop"])):
        rows = [(t, r) for t, r in run["rows"] if lo <= t < hi]
        verdict = verdict_for(fault, run["verdicts"], hi)
        ridden_out = fault["kind"] == "partition" and verdict is None and "duration_s" in fault
        if ridden_out:  # no host called lost: the recovery is the link up again, at its timer's time
            fault = {**fault, "restored": fault["time"] + fault["duration_s"]}
        one = {"name": fault["kind"], "exit": run["exit"], "start": lo, "steps": run["steps"], "rows": rows,
               "fault": fault, "verdict": verdict}
        m = measure(one, step_s)
        if ridden_out:
            m["found_as"] = "not lost (link up)"
        m.update(node=fault.get("node"), host=fault.get("host"), at_s=round(fault["time"] - run["start"], 1),
                 steps_redone=steps_redone(rows), final_step=useful_steps(rows))
        m["cause"] = (verdict or {}).get("cause")
        out.append(m)
    return out


def report(clean: dict, faulted: dict) -> dict:
    step_s = steady_step_s(clean["rows"])
    runs = {}
    for run in (clean, faulted):
        runs[run["name"]] = {**ettr(run["rows"], step_s, run["stop"] - run["start"]), "exit": run["exit"],
                             "attempts": len(run.get("attempts", [])) or None,
                             "startup_s": round(run["rows"][0][0] - run["start"], 2) if run["rows"] else None}
    for run in (clean, faulted):
        starts = [a["time"] for a in run.get("attempts", []) if "time" in a] or [run["start"]]
        runs[run["name"]]["own_pace"] = own_pace(run["rows"], starts, run["stop"] - run["start"])
    faults = per_fault(faulted, step_s)
    ratio = round(runs["faulted"]["ettr"] / runs["clean"]["ettr"], 4) if runs["clean"]["ettr"] else None
    own = [runs[n]["own_pace"]["ettr"] for n in ("clean", "faulted")]
    out = {"step_s": step_s, "runs": runs, "ettr_ratio": ratio, "faults": faults,
           "own_pace_ratio": round(own[1] / own[0], 4) if own[0] else None,
           "loss_differs_from": loss_differs_from(faulted["rows"], clean["rows"])}
    out["table"] = table(out, faulted)
    return out


def table(out: dict, faulted: dict) -> str:
    def cell(value, unit=""):
        return "-" if value is None else f"{value}{unit}"

    lines = [f"{'run':<8} {'wall':>8} {'useful':>7} {'rows':>6} {'redone':>6} {'productive':>10} {'ETTR':>7}",
             "-" * 60]
    for name, r in out["runs"].items():
        lines.append(f"{name:<8} {r['wall_s']:>7.1f}s {r['useful_steps']:>7} {r['rows']:>6} {r['steps_redone']:>6} "
                     f"{r['productive_s']:>9.1f}s {r['ettr']:>7.4f}")
    lines += [f"ETTR ratio (faulted / fault-free): {out['ettr_ratio']}; steady step {out['step_s'] * 1000:.0f} ms "
              f"(fault-free run)",
              f"with each attempt's own steady pace: ETTR {out['runs']['clean']['own_pace']['ettr']} (fault-free), "
              f"{out['runs']['faulted']['own_pace']['ettr']} (faulted), ratio {out['own_pace_ratio']}; attempts' "
              f"steps {out['runs']['faulted']['own_pace']['attempt_step_s']} s", "",
              f"{'at':>7} {'class':<18} {'node':>4} {'found as':<17} {'detect':>8} {'1st step':>9} {'redone':>6} "
              f"{'lost':>8}", "-" * 84]
    for m in out["faults"]:
        found = m["cause"] or m["found_as"]
        lines.append(f"{m['at_s']:>6}s {m['class']:<18} {cell(m['node']):>4} {cell(found):<17} "
                     f"{cell(m['detection_s'], ' s'):>8} {cell(m['first_step_after_s'], ' s'):>9} "
                     f"{m['steps_redone']:>6} {cell(m['lost_s'], ' s'):>8}")
    nodes = [a.get("nodes") for a in faulted.get("attempts", [])]
    if nodes:
        lines.append(f"faulted run's attempts (nodes): {nodes}")
    return "\n".join(lines)


def run_campaign(name: str, faults: list[dict], shards: Path, work: Path, minutes: float, interval: int,
                 nodes: int = 4, max_restarts: int = 8) -> dict:
    """One stage on a fresh cluster for ``minutes`` of wall time, ``faults`` (``schedule``'s) fired at
    their ``at_s``; stopped at the end. What it left, as ``cluster_faults_runs.run_class`` does."""
    import cluster_faults_runs as runs

    from megatrain.config import FaultConfig
    from megatrain.launch import cluster_services, hosts
    from megatrain.launch.host_faults import HostFaults, marker
    from megatrain.launch.nodes import host_role

    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    drop = ("train.steps=", "checkpoint.interval=", "checkpoint.keep_last=", "reliability.max_restarts=")
    args = [o for o in runs.overrides(run_dir, shards, 1, interval) if not o.startswith(drop)]
    args += ["train.steps=1000000", f"checkpoint.interval={interval}", "checkpoint.keep_last=5",
             f"reliability.max_restarts={max_restarts}"]
    cluster, _ = cluster_services.up(nodes, services=True, owner_pid=os.getpid())
    tail = runs.Tail(run_dir / "metrics.jsonl")
    tail.start()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRAIN_FAULTS="[]",
               MEGATRAIN_RUN_TOKEN=f"token-{run_dir.name}-0123456789ab")
    log = open(run_dir / "launcher.log", "w")
    pending, fired, verdicts, seen = list(faults), [], [], None
    lost_path = run_dir / "faults" / "host-lost.json"
    load_before, start = os.getloadavg(), time.time()
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.reliability.host_watch", "--cluster", cluster.name,
                             "--config", runs.CONFIG, "--nodes-dir", str(run_dir / "nodes"),
                             "--nodes", ",".join(map(str, range(nodes))), "--nproc-per-node", "1", *args],
                            cwd=runs.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    end_at, stop, exit_code, stopped = start + minutes * 60.0, None, None, False
    try:
        while True:
            now = time.time()
            if lost_path.exists():  # each attempt's verdict, kept as it appears (the next overwrites it)
                try:
                    text = lost_path.read_text()
                    if text != seen and text.strip():
                        verdicts.append(json.loads(text))
                        seen = text
                except (OSError, ValueError):
                    pass
            while pending and now >= start + pending[0]["at_s"]:
                f = pending.pop(0)
                cfg = FaultConfig(kind=f["kind"], step=0, node=f["node"],
                                  **{k: f[k] for k in ("duration_s", "rate") if k in f})
                injector = HostFaults([cfg], cluster, run_dir, host_role)
                injector.poll(0)
                fired.append({**f, **injector.fired[0]} if injector.fired else {**f, "skipped": True})
                print(f"{name}: {f['kind']} on node {f['node']} at {now - start:.1f} s", flush=True)
            if proc.poll() is not None:
                stop, exit_code = time.time(), proc.returncode
                break
            if now >= end_at:
                stop, stopped = now, True
                proc.send_signal(signal.SIGINT)
                try:
                    exit_code = proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    exit_code = proc.wait()
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        tail.stop.set()
        tail.join(timeout=5)
        for f in fired:
            if f.get("kind") == "slow_link":
                try:
                    cluster.clear_link(host_role(f["node"]))
                except RuntimeError:
                    pass
        try:
            checkpoints = runs.committed(cluster, run_dir)
        finally:
            time.sleep(max(0.0, max((f.get("duration_s", 0) for f in faults), default=0)))  # a heal's timer
            hosts.down(cluster.name)
    left = runs.leftovers(cluster.name, run_dir)
    records = []
    for f in fired:  # the markers again: a service's restore time is written into its marker later
        path = marker(run_dir, f["kind"], f.get("node", 0))
        records.append({**f, **(json.loads(path.read_text()) if path.exists() else {})})
    attempts = []  # each attempt's epoch and nodes, written at its start (host-attempts.jsonl: at its end)
    for stem in ("epochs", "host-attempts"):
        path = run_dir / f"{stem}.jsonl"
        found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        if stem == "epochs":
            attempts = found
        else:
            for row in found:  # how the attempts that ended ended
                if row["attempt"] - 1 < len(attempts):
                    attempts[row["attempt"] - 1].update(exit=row["exit"], lost=row["lost"])
    rows = [(t, {"step": r["step"], "loss": r["loss"], "step_time_s": r.get("step_time_s")})
            for t, r in tail.rows if t <= stop]
    text = (run_dir / "launcher.log").read_text()
    return {"name": name, "exit": exit_code, "stopped_at_end": stopped, "start": start, "stop": stop,
            "end": time.time(), "minutes": minutes, "steps": 1000000, "faults": records, "verdicts": verdicts,
            "attempts": attempts, "rows": rows, "committed": checkpoints, "cluster": cluster.name,
            "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
            "left": left, "log_tail": text[-3000:]}


def write(out_path: Path, clean: dict | None, faulted: dict | None, meta: dict) -> dict:
    doc = dict(meta)
    if clean and faulted:
        doc.update(report(clean, faulted))
    doc["run_records"] = [r for r in (clean, faulted) if r]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="campaign length, wall time from the launch")
    parser.add_argument("--every-minutes", type=float, default=4.0)
    parser.add_argument("--rotation", default=",".join(ROTATION))
    parser.add_argument("--partition-s", type=float, default=2.0)
    parser.add_argument("--service-s", type=float, default=4.0)
    parser.add_argument("--slow-rate", default="20mbit")
    parser.add_argument("--interval", type=int, default=20, help="checkpoint interval (steps)")
    parser.add_argument("--runs", default="clean,faulted", help="which campaigns to run, in this order")
    parser.add_argument("--work", default=None, help="folder for shards and runs (default: a new one in /var/tmp)")
    parser.add_argument("--out", default="runs/cluster-ettr.json")
    parser.add_argument("--report-from", default=None,
                        help="a JSON this wrote (or two, comma-separated: clean's and faulted's records): "
                             "the report again, printed and written to --out")
    args = parser.parse_args(argv)
    meta = {"command": " ".join(["benchmarks/cluster_ettr.py", *(argv if argv is not None else sys.argv[1:])])}
    if args.report_from:
        records = []
        for source in args.report_from.split(","):
            saved = json.loads(Path(source).read_text())
            records += [{**r, "rows": [tuple(row) for row in r["rows"]]} for r in saved["run_records"]]
            meta.update({k: saved[k] for k in ("commit", "work", "schedule", "minutes", "every_minutes")
                         if k in saved})
            meta.setdefault("measured_by", saved.get("measured_by") or saved.get("command"))
        by_name = {r["name"]: r for r in records}
        planned = {f["at_s"]: f for f in meta.get("schedule", [])}
        for fault in by_name.get("faulted", {}).get("faults", []):  # a record of before the schedule's terms were kept
            for key, value in planned.get(fault.get("at_s"), {}).items():
                fault.setdefault(key, value)
        doc = write(Path(args.out), by_name.get("clean"), by_name.get("faulted"), meta)
        print(doc.get("table", "no pair of clean and faulted runs"))
        return 0
    from megatrain.launch import hosts

    reason = hosts.available()
    if reason:
        print(f"cluster_ettr: {reason}", file=sys.stderr)
        return 2
    import cluster_faults_runs as runs

    plan = schedule(args.minutes, args.every_minutes, [c for c in args.rotation.split(",") if c],
                    args.partition_s, args.service_s, args.slow_rate)
    work = runs.work_dir(args.work)
    shards = runs.prepared_shards(work)
    meta.update(commit=runs.commit(), work=str(work), schedule=plan, minutes=args.minutes,
                every_minutes=args.every_minutes)
    done = {}
    for name in [r for r in args.runs.split(",") if r]:
        done[name] = run_campaign(name, plan if name == "faulted" else [], shards, work, args.minutes, args.interval)
        r = done[name]
        print(f"{name}: exit {r['exit']}, {len(r['rows'])} rows, highest step {useful_steps(r['rows'])}, "
              f"{r['stop'] - r['start']:.1f} s; left {r['left']}", flush=True)
        write(Path(args.out), done.get("clean"), done.get("faulted"), meta)  # what there is so far
    doc = write(Path(args.out), done.get("clean"), done.get("faulted"), meta)
    if "table" in doc:
        print(doc["table"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
