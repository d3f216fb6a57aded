"""Host faults on a cluster of hosts on this machine: what each costs, and the ETTR of a campaign with one
every few minutes.

    sudo .venv/bin/python benchmarks/cluster_faults.py [--classes host_down,partition,...] [--steps 24]
        [--fault-step 8] [--campaign-minutes 20] [--every-minutes 4] [--out runs/cluster-faults.json]

For each class (host_down, partition, slow_link, redis_host_down, storage_host_down) one short stage on a
fresh cluster, 4 node hosts x 1 CPU rank (benchmarks/cluster_faults_runs.py), the fault at
``--fault-step``, ``on_node_loss: shrink``; and one fault-free stage. Measured per class, from the fault's
marker (when it fired), the watch's verdict (when it was found) and the metrics rows with the wall time
each appeared:

- detection: verdict time - fault time (the watch's heartbeat silence, or the slow-link view's eviction);
  none for redis/storage host down, which no watch calls a lost host: they are the store's outage path;
- first step after recovery: the first row that appeared after the recovery (the verdict for a lost
  host: the shrunk attempt's first step; the service's restart for redis/storage), from the fault;
- steps redone: rows of steps trained again (the shrunk attempt restores the newest commit);
- lost: the time from the fault until the run is past the step it was in, less one steady step.

ETTR estimate (not a run of that length): a campaign of ``--campaign-minutes`` with a fault every
``--every-minutes``, the classes in turn, each costing its measured lost time, against the same campaign
without faults; both pay the fault-free stage's start-up (launch to its first step) once:
``ETTR = (T - startup - k x mean lost) / T`` with ``k = T / every``. What it leaves out: the capacity a
shrink gives up until the host rejoins (a real cluster replaces it) and faults that overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CLASSES = ("host_down", "partition", "slow_link", "redis_host_down", "storage_host_down")


def steady_step_s(rows: list[tuple[float, dict]]) -> float:
    """Median of the rows' step times after the first two (start-up, warm caches)."""
    times = [r["step_time_s"] for _, r in rows[2:] if r.get("step_time_s")] or [r["step_time_s"] for _, r in rows
                                                                                 if r.get("step_time_s")]
    return statistics.median(times) if times else float("nan")


def measure(result: dict, step_s: float) -> dict:
    """The numbers of one class's run (``cluster_faults_runs.run_class``'s dict); ``step_s``: the
    fault-free run's steady step time."""
    rows, fault, verdict = result["rows"], result["fault"], result["verdict"]
    steps = [r["step"] for _, r in rows]
    out = {"class": result["name"], "exit": result["exit"], "fired": fault is not None,
           "final_step": max(steps, default=0), "steps": result["steps"],
           "steps_redone": len(steps) - len(set(steps)), "detection_s": None, "first_step_after_s": None,
           "lost_s": None, "found_as": None}
    if fault is None:
        return out
    t0 = fault["time"]
    if verdict is not None:
        out["detection_s"] = round(verdict.get("detected_at", t0) - t0, 2)
        out["found_as"] = verdict.get("cause", "lost host")
        recovered = verdict.get("detected_at", t0)
    else:
        recovered = fault.get("restored", t0)
        out["found_as"] = "outage (retried)" if "restored" in fault else None
    after = [t for t, _ in rows if t > recovered]
    if after:
        out["first_step_after_s"] = round(min(after) - t0, 2)
    at_fault = max((r["step"] for t, r in rows if t <= t0), default=0)
    past = [t for t, r in rows if t > t0 and r["step"] > at_fault]
    if past:
        out["lost_s"] = round(max(0.0, min(past) - t0 - step_s), 2)
    return out


def ettr_estimate(measured: list[dict], startup_s: float, minutes: float, every_minutes: float) -> dict:
    total = minutes * 60.0
    lost = [m["lost_s"] for m in measured if m.get("lost_s") is not None]
    per_fault = statistics.mean(lost) if lost else 0.0
    faults = int(minutes // every_minutes) if every_minutes > 0 else 0
    clean = max(0.0, total - startup_s) / total
    faulted = max(0.0, total - startup_s - faults * per_fault) / total
    return {"campaign_minutes": minutes, "every_minutes": every_minutes, "faults": faults,
            "mean_lost_per_fault_s": round(per_fault, 2), "startup_s": round(startup_s, 2),
            "ettr_without_faults": round(clean, 4), "ettr_with_faults": round(faulted, 4),
            "ettr_ratio": round(faulted / clean, 4) if clean else None}


def table(measured: list[dict], ettr: dict, step_s: float) -> str:
    def cell(value, unit=""):
        return "-" if value is None else f"{value}{unit}"

    lines = [f"{'class':<18} {'found as':<17} {'detect':>8} {'1st step':>9} {'redone':>6} {'lost':>8} {'steps':>7}",
             "-" * 79]
    for m in measured:
        lines.append(f"{m['class']:<18} {cell(m['found_as']):<17} {cell(m['detection_s'], ' s'):>8} "
                     f"{cell(m['first_step_after_s'], ' s'):>9} {m['steps_redone']:>6} {cell(m['lost_s'], ' s'):>8} "
                     f"{m['final_step']:>3}/{m['steps']:<3}")
    lines += ["", f"steady step {step_s * 1000:.0f} ms (fault-free run), start-up {ettr['startup_s']} s",
              f"ETTR estimate, {ettr['campaign_minutes']:g} min with a fault every {ettr['every_minutes']:g} min "
              f"({ettr['faults']} faults, {ettr['mean_lost_per_fault_s']} s lost each): "
              f"{ettr['ettr_with_faults']:.3f} vs {ettr['ettr_without_faults']:.3f} without faults "
              f"(ratio {ettr['ettr_ratio']})"]
    return "\n".join(lines)


def report(results: list[dict], clean: dict, minutes: float, every: float) -> dict:
    step_s = steady_step_s(clean["rows"])
    startup = (clean["rows"][0][0] - clean["start"]) if clean["rows"] else 0.0
    measured = [measure(r, step_s) for r in results]
    ettr = ettr_estimate(measured, startup, minutes, every)
    return {"step_s": step_s, "classes": measured, "ettr": ettr, "table": table(measured, ettr, step_s),
            "clean": {"exit": clean["exit"], "final_step": max((r["step"] for _, r in clean["rows"]), default=0),
                      "wall_s": round(clean["end"] - clean["start"], 1)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--interval", type=int, default=4, help="checkpoint interval")
    parser.add_argument("--fault-step", type=int, default=8)
    parser.add_argument("--campaign-minutes", type=float, default=20.0)
    parser.add_argument("--every-minutes", type=float, default=4.0)
    parser.add_argument("--work", default=None, help="folder for shards and runs (default: a new one in /var/tmp)")
    parser.add_argument("--out", default="runs/cluster-faults.json")
    args = parser.parse_args(argv)
    from megatrain.launch import hosts

    reason = hosts.available()
    if reason:
        print(f"cluster_faults: {reason}", file=sys.stderr)
        return 2
    import cluster_faults_runs as runs

    classes = [c for c in args.classes.split(",") if c]
    unknown = sorted(set(classes) - set(CLASSES))
    if unknown:
        parser.error(f"unknown classes {unknown}; known: {', '.join(CLASSES)}")
    work = runs.work_dir(args.work)
    shards = runs.prepared_shards(work)
    clean = runs.run_class(None, shards, work, args.steps, args.interval, args.fault_step)
    results = []
    for name in classes:
        results.append(runs.run_class(name, shards, work, args.steps, args.interval, args.fault_step))
        print(f"{name}: exit {results[-1]['exit']}, {len(results[-1]['rows'])} rows", flush=True)
    out = report(results, clean, args.campaign_minutes, args.every_minutes)
    out["runs"] = [{k: r[k] for k in ("name", "exit", "fault", "verdict", "log_tail")} for r in results]
    out["work"] = str(work)
    print(out["table"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
