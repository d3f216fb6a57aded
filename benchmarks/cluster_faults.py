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
  host: the shrunk attempt's first step; the service back for redis/storage), from the fault;
- steps redone: rows of steps trained again (the shrunk attempt restores the newest commit);
- lost: how much later than a steady run the run got past the highest step it reached before the
  recovery (the step it was in for a lost host; a slow link trains on, slowly, until its eviction): the
  first row past that step after the recovery, less the last row before the fault, less a steady step
  for each step in between (the fault fires within a launcher poll, 0.2 s, of a row: counting from the
  fault itself would hide up to a step). A fault that outlived the stage (a slow link not evicted, a
  service back after the last step while the ranks trained on): the extra time until the stage's last
  row (``recovered: false``; a floor where the fault still cost time at the end).

Checked per class against the fault-free stage: the first step whose loss differs from its loss
(``loss_differs_from``, none: every step equal bit for bit; a shrunk attempt trains at another
accumulation, so its sums differ in the last bits), and the committed checkpoints, read back from the
storage host's S3 (``committed``; for a service outage also those committed after the service was back,
``committed_after_restore``: the uploads and commits that waited it out).

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
    """Median wall time between consecutive rows after the first two (start-up, warm caches): what a
    step costs the run, checkpoint saves and logging included, which a rank's ``step_time_s`` leaves out.
    Too few rows: the median ``step_time_s``."""
    times = [t for t, _ in rows[2:]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if len(gaps) >= 3:
        return statistics.median(gaps)
    own = [r["step_time_s"] for _, r in rows if r.get("step_time_s")]
    return statistics.median(own) if own else float("nan")


def loss_differs_from(rows: list[tuple[float, dict]], clean_rows: list[tuple[float, dict]]) -> int | None:
    """The first step whose loss (the last attempt's, where a step was trained twice) is not the
    fault-free run's; None when every step of the run equals it. A step the clean run lacks differs."""
    ours = {r["step"]: r["loss"] for _, r in rows}
    clean = {r["step"]: r["loss"] for _, r in clean_rows}
    return next((step for step in sorted(ours) if clean.get(step) != ours[step]), None)


def measure(result: dict, step_s: float, clean_rows: list[tuple[float, dict]] | None = None) -> dict:
    """The numbers of one class's run (``cluster_faults_runs.run_class``'s dict); ``step_s``: the
    fault-free run's steady step time; ``clean_rows``: its rows, for ``loss_differs_from``."""
    rows, fault, verdict = result["rows"], result["fault"], result["verdict"]
    steps = [r["step"] for _, r in rows]
    out = {"class": result["name"], "exit": result["exit"], "fired": fault is not None,
           "final_step": max(steps, default=0), "steps": result["steps"],
           "steps_redone": len(steps) - len(set(steps)), "detection_s": None, "first_step_after_s": None,
           "lost_s": None, "found_as": None, "recovered": None}
    if clean_rows is not None:
        out["loss_differs_from"] = loss_differs_from(rows, clean_rows)
    if result.get("committed") is not None:  # a JSON of an older run has none
        found = result["committed"]
        out["committed"] = sorted(int(step) for step in found) if "error" not in found else found["error"]
        restored = (fault or {}).get("restored")
        if restored is not None and "error" not in found:
            out["committed_after_restore"] = sorted(int(step) for step, c in found.items()
                                                    if (c.get("committed_at") or 0) > restored)
    if fault is None:
        return out
    t0 = fault["time"]
    if verdict is not None:
        out["detection_s"] = round(verdict.get("detected_at", t0) - t0, 2)
        out["found_as"] = verdict.get("cause", "lost host")
        recovered = verdict.get("detected_at", t0)
    else:
        recovered = fault.get("restored")
        out["found_as"] = "service outage" if recovered is not None else None
    before = [(t, r["step"]) for t, r in rows if t <= t0]
    last_t, at_fault = max(before, default=(result["start"], 0))
    # recovered within the stage: a row came after the verdict or the service's restart
    out["recovered"] = recovered is not None and any(t > recovered for t, _ in rows)
    if not out["recovered"]:  # the fault outlived the stage (a slow link never evicted, a store back after
        # the last step while the ranks trained on): the extra time until the stage's last row
        if rows and max(steps) > at_fault:
            end_t = max(t for t, _ in rows)
            out["lost_s"] = round(max(0.0, end_t - last_t - (max(steps) - at_fault) * step_s), 2)
        return out
    after = [t for t, _ in rows if t > recovered]
    if after:
        out["first_step_after_s"] = round(min(after) - t0, 2)
    # the highest step reached before the recovery (a slow link trains slowly until its eviction): the
    # run is back once past it; the steps from the fault's to that one would have taken a steady step each
    reached = max([at_fault, *(r["step"] for t, r in rows if t0 < t <= recovered)])
    past = [t for t, r in rows if t > recovered and r["step"] > reached]
    if past:
        out["lost_s"] = round(max(0.0, min(past) - last_t - (reached + 1 - at_fault) * step_s), 2)
    return out


def ettr_estimate(measured: list[dict], startup_s: float, minutes: float, every_minutes: float) -> dict:
    """``(T - startup - k x mean lost) / T``, ``k = floor(T / every)``: the mean over the classes that
    gave a lost time; those that did not are named (``not_counted``), never counted as free."""
    if minutes <= 0:
        raise ValueError(f"--campaign-minutes must be positive, got {minutes}")
    total = minutes * 60.0
    counted = [m for m in measured if m.get("lost_s") is not None]
    per_fault = statistics.mean(m["lost_s"] for m in counted) if counted else 0.0
    faults = int(minutes // every_minutes) if every_minutes > 0 else 0
    clean = max(0.0, total - startup_s) / total
    faulted = max(0.0, total - startup_s - faults * per_fault) / total
    return {"campaign_minutes": minutes, "every_minutes": every_minutes, "faults": faults,
            "counted": [m["class"] for m in counted],
            "not_counted": [m["class"] for m in measured if m.get("lost_s") is None],
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
    if ettr["not_counted"]:
        lines.append(f"not in the mean (no lost time measured): {', '.join(ettr['not_counted'])}")
    for m in measured:
        if "loss_differs_from" in m or "committed" in m:
            differs = m.get("loss_differs_from")
            same = "-" if "loss_differs_from" not in m else "every step equal" if differs is None else \
                f"differs from step {differs}"
            after = f", after the restore {m['committed_after_restore']}" if "committed_after_restore" in m else ""
            lines.append(f"{m['class']}: losses vs the fault-free run: {same}; "
                         f"committed {m.get('committed', '-')}{after}")
    return "\n".join(lines)


def report(results: list[dict], clean: dict, minutes: float, every: float) -> dict:
    step_s = steady_step_s(clean["rows"])
    startup = (clean["rows"][0][0] - clean["start"]) if clean["rows"] else 0.0
    measured = [measure(r, step_s, clean["rows"]) for r in results]
    ettr = ettr_estimate(measured, startup, minutes, every)
    return {"step_s": step_s, "classes": measured, "ettr": ettr, "table": table(measured, ettr, step_s),
            "clean": {"exit": clean["exit"], "final_step": max((r["step"] for _, r in clean["rows"]), default=0),
                      "wall_s": round(clean["end"] - clean["start"], 1)}}


RUN_KEYS = ("name", "exit", "cluster", "start", "end", "steps", "fault", "verdict", "load", "left", "rows", "committed",
            "log_tail")


def document(results: list[dict], clean: dict, minutes: float, every: float, meta: dict) -> dict:
    """The JSON written: ``report``'s numbers, each run's record (what fired, the verdict, the load
    average before and after, what was left of its cluster) and ``meta`` (command, commit, work)."""
    out = report(results, clean, minutes, every)
    out["minutes"], out["every_minutes"] = minutes, every
    out["runs"] = [{k: r.get(k) for k in RUN_KEYS} for r in [clean, *results]]
    out.update(meta)
    return out


def report_again(source: Path, out: Path, minutes: float, every: float) -> int:
    try:
        saved = json.loads(source.read_text())
        runs = [{**r, "rows": [tuple(row) for row in r["rows"]]} for r in saved["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--report-from {source}: not a cluster_faults JSON with its runs' rows ({exc})") from None
    meta = {k: saved.get(k) for k in ("command", "commit", "work")}
    again = document(runs[1:], runs[0], minutes, every, meta)
    print(again["table"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(again, indent=1, default=str))
    print(f"wrote {out}")
    return 0


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
    parser.add_argument("--report-from", default=None, help="a JSON this wrote: its report again from its runs' "
                        "records (no cluster), printed and written to --out")
    args = parser.parse_args(argv)
    if args.report_from:
        return report_again(Path(args.report_from), Path(args.out), args.campaign_minutes, args.every_minutes)
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
    out = document(results, clean, args.campaign_minutes, args.every_minutes,
                   {"command": " ".join(["benchmarks/cluster_faults.py", *(argv if argv is not None else sys.argv[1:])]),
                    "commit": runs.commit(), "work": str(work)})
    print(out["table"])
    for run in out["runs"]:
        if any(run["left"].values()):
            print(f"{run['name']}: left behind after hosts.down: {run['left']}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
