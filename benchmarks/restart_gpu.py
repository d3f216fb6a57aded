"""Launch -> first step finished, phase by phase: a cold start against restarts that find the compile
cache (and, with a warm standby, the imports and CUDA already done), for each recipe, in one run.

For each recipe, in one run dir (so every start after the first finds its compile cache):

1. ``cold``: a fresh process, an empty compile cache, no checkpoint (trains step 1, commits it);
2. ``restart``: a fresh process, as a restart after a fault: the compile cache present, step 1
   restored (trains step 2);
3. ``restart+standby``: a warm standby process (imported, CUDA initialized, waiting;
   megatrain/training/standby.py) handed its rank, the compile cache present, step 2 restored
   (trains step 3); skipped with ``--no-standby``.

Each row is the launcher's wall time from starting (or handing over) the rank to the end of its
first step, and the rank's own breakdown (``startup.json``: imports, store, groups, data, model,
engine, checkpoint restore, compile, first step; megatrain/observe/startup.py) with the FX graph
cache hits. One rank (the first visible GPU, or the CPU with ``--device cpu``).

    python benchmarks/restart_gpu.py --recipes configs/gpt-125m.yaml configs/gpt-1.3b.yaml --out restart.json

``--tier keeper`` measures the keeper tier (RAM checkpoints, megatrain/checkpoint/memory.py) instead:
after the cold start, a run with snapshots into the keeper every step (``checkpoint.memory_interval=1``)
and no durable commit before its end is killed at the start of its step 3 (a ``kill_rank`` fault), so
the keeper holds step 2 and the durable store step 1; the measured ``restart`` then restores step 2
from the keeper. Before ``restart+standby`` another such run is killed at the start of step 5, and
the standby restores step 4 from the keeper. Every row says which tier its restore came from and its seconds (``restores.jsonl``).

A 1.3B checkpoint is 17 GiB and the preflight wants room for two staged and two durable ones:
``--staging`` (e.g. a tmpfs) and ``--durable`` put them elsewhere when the run dir's disk is small.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STARTS = ("cold", "restart", "restart+standby")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["configs/gpt-125m.yaml", "configs/gpt-1.3b.yaml"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--root", default=None, help="where the run dirs go (default: a temporary folder, removed)")
    parser.add_argument("--staging", default=None, help="checkpoint staging root (default: in each run dir)")
    parser.add_argument("--durable", default=None, help="committed checkpoints root (default: in each run dir)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--no-standby", action="store_true", help="leave out the warm-standby restart")
    parser.add_argument("--tier", default="durable", choices=["durable", "keeper"],
                        help="the tier the measured restarts restore from (keeper: see the module docstring)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per start")
    parser.add_argument("--out", default="restart_gpu.json")
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every start, e.g. model.n_layer=2")
    return parser.parse_args(argv)


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()} (torch {torch.__version__})"


def run_overrides(args: argparse.Namespace, recipe: str, run_dir: Path, steps: int) -> list[str]:
    name = Path(recipe).stem
    staging = Path(args.staging) / name if args.staging else run_dir / "staging"
    durable = Path(args.durable) / name if args.durable else run_dir / "checkpoints"
    return [f"train.steps={steps}", f"train.run_dir={run_dir}", f"train.device={args.device}",
            f"train.micro_batch_size={args.micro_batch}", f"train.global_batch_size={args.micro_batch}",
            "optim.decay_steps=3",  # the same schedule for 1, 2 and 3 steps: each restart resumes the last
            "train.eval_interval=0", "train.tensorboard=false", "checkpoint.interval=1", "checkpoint.keep_last=1",
            f"checkpoint.staging_dir={staging}", f"checkpoint.durable_url={durable}",
            "data.max_source_bytes=4000000", *args.overrides]


def rank_env(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.pop("MEGATRAIN_COMPILE_CACHE_DIR", None)  # the run dir's own folder: cold means empty
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if device == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    return env


def start_process(config: str, overrides: list[str], env: dict, timeout_s: float,
                  killed: bool = False) -> tuple[float, list[str]]:
    """A fresh rank process (``megatrain train``'s one-process path); returns (launch time, output).
    ``killed``: the process must die of its injected fault (a non-zero exit) instead of finishing."""
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatrain.train", "--config", config, *overrides],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = (proc.stdout + proc.stderr).splitlines()
    if killed:
        if proc.returncode == 0 or not any("injecting fault kill_rank" in line for line in output):
            raise SystemExit(f"{config}: the run to be killed exited {proc.returncode}:\n" + "\n".join(output[-30:]))
    elif proc.returncode != 0:
        raise SystemExit(f"{config}: exit {proc.returncode}:\n" + "\n".join(output[-30:]))
    return launched, output


def start_standby(config: str, overrides: list[str], env: dict, timeout_s: float) -> tuple[float, list[str]]:
    """A warm standby process, waited for until it has imported, then handed rank 0; returns (hand-over
    time, output)."""
    from megatrain.launch import standby

    launch = standby.StandbyLaunch(["--config", config, *overrides], 1)
    launch.prepare_next(env, ROOT)
    waiting = standby._WAITING[standby.standby_key(1, env, ROOT)]
    if not waiting.wait_ready(timeout_s):
        raise SystemExit("the standby process did not finish its imports")
    output: list[str] = []
    handed_over = time.time()
    group = launch.start(env, ROOT, output.append, collections.deque(maxlen=400))
    code = group.wait(timeout_s)
    if code != 0:
        group.stop(grace_s=0.0)
        raise SystemExit(f"{config} (standby): exit {code}:\n" + "\n".join(output[-30:]))
    return handed_over, output


def measure(args: argparse.Namespace, recipe: str, root: Path) -> list[dict]:
    from megatrain.observe.startup import read_startup

    run_dir = root / Path(recipe).stem
    shutil.rmtree(run_dir, ignore_errors=True)  # a cold start: no checkpoint, no compile cache
    env = rank_env(args.device)
    rows = []
    for steps, start in enumerate(STARTS, start=1):
        if start == "restart+standby" and args.no_standby:
            continue
        overrides = run_overrides(args, recipe, run_dir, steps)
        if start != "cold" and args.tier == "keeper":
            last = KEEPER_STEPS if start == "restart" else KEEPER_STEPS + 2  # each killed run trains on
            overrides = run_overrides(args, recipe, run_dir, last) + KEEPER_OVERRIDES
            killed_env = {**env, "MEGATRAIN_FAULTS": json.dumps([{"kind": "kill_rank", "step": last}])}
            start_process(recipe, overrides, killed_env, args.timeout_s, killed=True)  # leaves last - 1 in the keeper
        runner = start_standby if start.endswith("standby") else start_process
        launched, _ = runner(recipe, overrides, env, args.timeout_s)
        startup = read_startup(run_dir)
        rows.append({"recipe": Path(recipe).stem, "start": start,
                     "launch_to_first_step_s": round(startup["first_step_at"] - launched, 2),
                     "phases_s": startup["phases_s"], "other_s": startup["other_s"],
                     "compile_cache": startup.get("compile_cache"),
                     "restore": last_restore(run_dir, since=launched)})
        print_row(rows[-1])
    return rows


# --tier keeper: the run before the measured restart snapshots every step into the keeper, commits
# durably only at its end (which it never reaches), and is killed at the start of step KEEPER_STEPS.
KEEPER_STEPS = 3
KEEPER_OVERRIDES = ["checkpoint.interval=1000", "checkpoint.memory_interval=1"]


def last_restore(run_dir: Path, since: float) -> dict | None:
    """The tier, step and seconds of the restore this start did (restores.jsonl), or None."""
    path = run_dir / "restores.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = [row for row in rows if row.get("time", 0) >= since]
    return {k: rows[-1][k] for k in ("tier", "step", "seconds", "phases_s") if k in rows[-1]} if rows else None


def print_row(row: dict) -> None:
    phases = "  ".join(f"{k} {v:.2f}" for k, v in row["phases_s"].items())
    cache = row["compile_cache"] or {}
    hits = f"  cache hits {cache.get('fxgraph_hits', '-')}/misses {cache.get('fxgraph_misses', '-')}" if cache else ""
    restore = row.get("restore")
    parts = "".join(f", {k} {v:.2f}" for k, v in (restore or {}).get("phases_s", {}).items())
    tier = f"  restore: {restore['tier']} step {restore['step']} {restore['seconds']:.2f} s{parts}" if restore else ""
    print(f"{row['recipe']:<10} {row['start']:<16} {row['launch_to_first_step_s']:>8.2f} s  [{phases}]{hits}{tier}",
          flush=True)


def table(rows: list[dict]) -> str:
    phases = list(rows[0]["phases_s"]) if rows else []
    head = ["recipe", "start", "launch->step s", *phases, "graph hits", "restore tier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cache = row["compile_cache"] or {}
        cells = [row["recipe"], row["start"], f"{row['launch_to_first_step_s']:.2f}",
                 *(f"{row['phases_s'].get(p, 0.0):.2f}" for p in phases),
                 f"{cache.get('fxgraph_hits', '-')}/{cache.get('fxgraph_hits', 0) + cache.get('fxgraph_misses', 0)}"
                 if cache else "-",
                 (row.get("restore") or {}).get("tier", "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    device = device_name(args.device)
    print(f"device: {device}", flush=True)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="restart-gpu-"))
    result = {"device": device, "rows": []}
    try:
        for recipe in args.recipes:
            result["rows"] += measure(args, recipe, root)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # a run cut short keeps its rows
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\ndevice: {device}\n{table(result['rows'])}\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
