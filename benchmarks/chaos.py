"""Chaos benchmark: inject each fault into a set of stand-in ranks and time its detection.

The ranks here are small processes that behave like training ranks to the reliability layer -
they beat heartbeats through the phases of a step, feed a loss to the anomaly detector, time
their compute, and call the fault injector's hooks - but train no model, so every scenario
takes seconds on a CPU. (The end-to-end recovery test with real training lives with the flows.)

    python benchmarks/chaos.py [--ranks 4] [--timeout 2] [--interval 0.5] [--out runs/chaos]
    python benchmarks/chaos.py --campaign [--repeat 3] [-k hang]   # the real fault matrix, see below
    python benchmarks/chaos.py --ettr [--minutes 30] [--every 180]  # ETTR under chaos (chaos_ettr.py)

Scenarios and what counts as detected:
  kill_rank   the watcher reports the rank dead         (bound: timeout + 2 intervals)
  hang_rank   the watcher reports it hung, with a stack (bound: timeout + 2 intervals)
  nan_loss    the anomaly verdict file appears          (bound: one step)
  slow_rank   find_stragglers names the rank            (bound: warm-up + window steps)
Prints a table and writes chaos.json, the who-hung grid and the straggler heat map to --out.

``--campaign`` runs the end-to-end fault matrix instead (tests/flows/test_fault_matrix_ranks.py and
test_fault_matrix_services.py: the real ``pretrain`` flow, real ranks, one case per fault, bit-exact
checks against a fault-free run) ``--repeat`` times and prints each fault's detection and recovery
times (median and max over the repeats); it writes campaign.json. Several minutes per repeat on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatrain.config import AnomalyConfig, FaultConfig
from megatrain.report.hang_view import Layout, grid_from_watch, plot_hang_grid, render_markdown
from megatrain.observe.straggler import find_stragglers, plot_heatmap
from megatrain.reliability.anomaly import AnomalyDetector, read_verdict, write_verdict
from megatrain.reliability.faults import FAULTS_ENV, FaultInjector, faults_from_env
from megatrain.reliability.heartbeat import DirectorySink, HeartbeatWriter
from megatrain.reliability.watcher import HeartbeatWatcher

STEP_S = 0.05  # a stand-in step's compute time
STRAGGLER_ARGS = {"warmup_steps": 3, "window": 20}
# --campaign: the flow-level cases of the fault matrix (one module for faults of a rank, one for the rest)
CAMPAIGN_MATRIX = ["tests/flows/test_fault_matrix_ranks.py", "tests/flows/test_fault_matrix_services.py"]


def rank_main(rank: int, run_dir: Path, interval_s: float, steps: int) -> int:
    """One stand-in rank: the reliability hooks of a training step, in the trainer's order."""
    writer = HeartbeatWriter(DirectorySink(run_dir / "heartbeats"), rank, interval_s=interval_s,
                             stacks_dir=run_dir / "stacks")
    injector = FaultInjector(faults_from_env(), rank, run_dir)
    detector = AnomalyDetector(AnomalyConfig(warmup_steps=5))
    rng = random.Random(rank)
    timings = (run_dir / "timings").open("a")
    for step in range(1, steps + 1):
        start = time.perf_counter()
        injector.on_step_start(step)
        for phase in ("data", "forward", "backward", "optimizer"):
            writer.beat(phase=phase)
            time.sleep(STEP_S / 4 * (1 + 0.03 * rng.gauss(0, 1)))
        compute_s = time.perf_counter() - start
        timings.write(json.dumps({"rank": rank, "step": step, "s": compute_s}) + "\n")
        timings.flush()
        writer.beat(phase="collective")
        loss = injector.transform_loss(step, 3.0 / step**0.1 + 0.01 * rng.gauss(0, 1))
        writer.beat(step=step, loss=loss)
        verdict = detector.observe(step, loss)
        if verdict is not None:
            write_verdict(run_dir, verdict)
            writer.close(phase=None)
            return 3
    writer.close()
    return 0


def fired_at(run_dir: Path) -> float | None:
    """When the fault fired: its once-marker is written just before it does."""
    markers = list((run_dir / "faults").glob("fired-*.json"))
    return min(m.stat().st_mtime for m in markers) if markers else None


def run_scenario(kind: str, args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / kind
    run_dir.mkdir(parents=True, exist_ok=True)
    victim = args.ranks - 1
    fault = FaultConfig(kind=kind, rank=victim, step=10, slowdown=0.3)
    env = {**os.environ, FAULTS_ENV: json.dumps([fault.model_dump()])}
    steps = 10 + STRAGGLER_ARGS["window"] + 5 if kind == "slow_rank" else 400
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--run-dir", str(run_dir),
                               "--interval", str(args.interval), "--steps", str(steps)], env=env)
             for r in range(args.ranks)]
    watcher = HeartbeatWatcher(DirectorySink(run_dir / "heartbeats"), args.ranks, args.timeout,
                               init_timeout_s=30, stacks_dir=run_dir / "stacks")
    row = {"scenario": kind, "rank": victim, "detected": False, "latency_s": None, "detail": ""}
    deadline = time.time() + 60
    try:
        while time.time() < deadline and not row["detected"]:
            time.sleep(0.05)
            start = fired_at(run_dir)
            if kind in ("kill_rank", "hang_rank"):
                result = watcher.check()
                faulty = result.dead if kind == "kill_rank" else result.hung
                if victim in faulty and start is not None:
                    row.update(detected=True, latency_s=time.time() - start,
                               bound_s=args.timeout + 2 * args.interval)
                    stacks = watcher.collect_stacks(result, [victim]) if kind == "hang_rank" else {}
                    row["detail"] = "stack names hang_forever" if "hang_forever" in stacks.get(victim, "") else ""
                    cells = grid_from_watch(result, Layout(dp=args.ranks))
                    plot_hang_grid(cells, Layout(dp=args.ranks), out / f"who_hung_{kind}.png")
                    (out / f"who_hung_{kind}.md").write_text(render_markdown(cells, Layout(dp=args.ranks)))
            elif kind == "nan_loss":
                verdict = read_verdict(run_dir)
                if verdict is not None and start is not None:
                    latency = (run_dir / "verdict.json").stat().st_mtime - start
                    row.update(detected=True, latency_s=latency, bound_s=STEP_S * 2, detail=verdict.kind)
            elif all(p.poll() is not None for p in procs):  # slow_rank: judge the finished run
                rows = [json.loads(line) for line in (run_dir / "timings").read_text().splitlines()]
                matrix = np.zeros((steps, args.ranks))
                for r in rows:
                    matrix[r["step"] - 1, r["rank"]] = r["s"]
                found = find_stragglers(matrix, **STRAGGLER_ARGS)
                plot_heatmap(matrix, out / "stragglers.png", flagged=found)
                row.update(detected=found == [victim], detail=f"stragglers {found}")
                break
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return row


def run_campaign_matrix(args: argparse.Namespace, out: Path) -> int:
    """The flow-level fault matrix, ``args.repeat`` times; a table of its times per fault."""
    root = Path(__file__).resolve().parents[1]
    runs, failed = [], 0
    for i in range(args.repeat):
        table = out / f"campaign-{i + 1}.json"
        command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                   *CAMPAIGN_MATRIX, *(["-k", args.k] if args.k else [])]
        start = time.monotonic()
        done = subprocess.run(command, cwd=root, env={**os.environ, "MEGATRAIN_FAULT_TABLE": str(table)})
        failed += done.returncode != 0
        rows = json.loads(table.read_text()) if table.exists() else []
        runs.append({"repeat": i + 1, "returncode": done.returncode, "wall_s": time.monotonic() - start, "rows": rows})
    by_fault: dict[str, list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            by_fault.setdefault(row["fault"], []).append(row)

    def stats(values: list[float | None]) -> str:
        known = sorted(v for v in values if v is not None)
        return "-" if not known else f"{known[len(known) // 2]:.2f} / {known[-1]:.2f}"

    print(f"{'fault':<18} {'n':>2} {'detect s (med/max)':>19} {'recover s (med/max)':>20} {'attempts':>8}  bit-exact  detected by")
    for fault, rows in by_fault.items():
        exact = {str(r["bit_exact"]) for r in rows}
        print(f"{fault:<18} {len(rows):>2} {stats([r['detection_s'] for r in rows]):>19} "
              f"{stats([r['recovery_s'] for r in rows]):>20} {max(r['attempts'] for r in rows):>8}  "
              f"{'/'.join(sorted(exact)):<9}  {rows[0]['detected by']}")
    walls = ", ".join(f"{r['wall_s']:.0f} s" for r in runs)
    print(f"{len(runs)} run(s), {failed} failed; wall {walls}")
    (out / "campaign.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    print(f"wrote {out}/campaign.json")
    return 0 if failed == 0 else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--out", default="runs/chaos")
    parser.add_argument("--campaign", action="store_true", help="run the end-to-end fault matrix through the flow")
    parser.add_argument("--repeat", type=int, default=1, help="--campaign: how many times")
    parser.add_argument("-k", default="", help="--campaign: pytest -k expression (a subset of the faults)")
    parser.add_argument("--ettr", action="store_true", help="ETTR of a real campaign under random faults")
    parser.add_argument("--minutes", type=float, default=30.0, help="--ettr: fault-free training length")
    parser.add_argument("--every", type=float, default=180.0, help="--ettr: mean seconds between faults")
    parser.add_argument("--ckpt-interval", type=int, default=20, help="--ettr: checkpoint interval (steps)")
    parser.add_argument("--seed", type=int, default=0, help="--ettr: fault draw")
    parser.add_argument("--recipe", default="configs/tiny-cpu.yaml",
                        help="--ettr: the stage's recipe (the default one is shrunk to ~0.07 s steps on CPU)")
    parser.add_argument("--nproc", type=int, default=2, help="--ettr: ranks")
    parser.add_argument("--step-s", type=float, default=None,
                        help="--ettr: step time that turns minutes into steps (default: a probe run measures it); "
                             "the same value, seed and minutes give two runs the same steps and fault schedule")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="--ettr: a recipe override for the campaign (repeatable), e.g. reliability.warm_standby=true")
    parser.add_argument("--reanalyse", metavar="OUT", help="--ettr: the breakdown of the finished run in OUT again")
    parser.add_argument("--console", metavar="LOG", help="--reanalyse: that run's console output")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # internal: run one stand-in rank
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=400, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args.rank, Path(args.run_dir), args.interval, args.steps)

    if args.ettr and args.reanalyse:
        from chaos_ettr import reanalyse

        return reanalyse(Path(args.reanalyse), Path(args.console))
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    if args.ettr:
        from chaos_ettr import run_ettr

        out.mkdir(parents=True, exist_ok=True)
        return run_ettr(args, out.resolve())
    if args.campaign:
        out.mkdir(parents=True, exist_ok=True)
        return run_campaign_matrix(args, out)
    rows = [run_scenario(kind, args, out) for kind in ("kill_rank", "hang_rank", "nan_loss", "slow_rank")]
    print(f"{'scenario':<10} {'rank':>4} {'detected':>8} {'latency_s':>9} {'bound_s':>7}  detail")
    for r in rows:
        latency = "-" if r["latency_s"] is None else f"{r['latency_s']:.2f}"
        bound = f"{r['bound_s']:.2f}" if "bound_s" in r else "-"
        print(f"{r['scenario']:<10} {r['rank']:>4} {str(r['detected']):>8} {latency:>9} {bound:>7}  {r['detail']}")
    (out / "chaos.json").write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    print(f"wrote {out}/chaos.json")
    ok = all(r["detected"] and (r["latency_s"] is None or r["latency_s"] <= r.get("bound_s", 1e9)) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
