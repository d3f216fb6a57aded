"""Where a training step makes the GPU wait for the host (one GPU): the three things that drain the
queue the host has launched ahead, measured on a recipe through the trainer.

1. Host-to-device copies: the host time of a batch-sized copy queued behind 0.3 s of GPU work,
   from pageable and from pinned memory. A copy that waits for the stream drains it.
2. Synchronising calls: ``torch.cuda.set_sync_debug_mode("warn")`` over the timed steps; every
   call site (file:line of the innermost megatrain / DeepSpeed frames) with its count per step.
3. Each phase of one step as the GPU ran it (CUDA events), in order: a phase whose GPU time far
   exceeds its kernels' (a data phase of milliseconds) is the GPU waiting for the host there.

    python benchmarks/host_waits.py configs/moe-gpu-2b.yaml --out runs/host-waits.json \\
        train.device=cuda train.micro_batch_size=32 train.global_batch_size=128

Prints a table per part and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from megatrain.config import load_config  # noqa: E402
from megatrain.parallel.init import init_distributed, shutdown_distributed  # noqa: E402
from megatrain.training.trainer import Trainer  # noqa: E402


def copy_waits(shape: tuple[int, int]) -> dict[str, float]:
    """Host milliseconds of ``.to("cuda", non_blocking=True)`` behind 0.3 s of queued GPU work."""
    out = {}
    for kind in ("pageable", "pinned"):
        host = torch.randint(0, 50_000, shape)
        host = host.pin_memory() if kind == "pinned" else host
        torch.cuda.synchronize()
        torch.cuda._sleep(int(0.3 * torch.cuda.clock_rate() * 1e6))  # clock_rate: MHz
        start = time.perf_counter()
        host.to("cuda", non_blocking=True)
        out[kind] = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
    return out


class SyncSites:
    """Counts the synchronising calls torch reports, by the innermost frames of ours or DeepSpeed's."""

    def __init__(self) -> None:
        self.sites: Counter = Counter()
        self._show = warnings.showwarning

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "megatrain" in f.filename or "deepspeed" in f.filename]
        self.sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])] += 1

    def __enter__(self) -> "SyncSites":
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show


def step_spans(trainer: Trainer) -> list[tuple[str, float]]:
    """One train_step's phases in order, each with its GPU milliseconds (start to end event)."""
    timers = trainer.timers
    trainer.train_step()
    step = timers._pending[-1]
    timers.flush()  # synchronises
    return [(name, timers._elapsed(start, end)) for name, start, end in step.spans]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after two warm-up steps")
    parser.add_argument("--out", default="runs/host-waits.json")
    args = parser.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    env = init_distributed(device=cfg.train.device)
    cuda = torch.cuda.is_available()
    result: dict = {"config": args.config, "overrides": args.overrides,
                    "device": torch.cuda.get_device_name() if cuda else "cpu"}
    try:
        if cuda:
            result["copy_host_ms"] = copy_waits((cfg.train.micro_batch_size, cfg.seq_len))
            print("host ms of a batch copy behind 0.3 s of GPU work:", result["copy_host_ms"], flush=True)
        with torch.device(env.device):
            trainer = Trainer(cfg, env)
        for _ in range(2):
            trainer.train_step()
        with SyncSites() as syncs:
            for _ in range(args.steps):
                trainer.train_step()
        result["sync_sites_per_step"] = {k: v / args.steps for k, v in syncs.sites.most_common()}
        print(f"synchronising calls per step ({args.steps} steps):")
        for site, n in result["sync_sites_per_step"].items():
            print(f"  {n:6.1f}  {site}")
        spans = step_spans(trainer)
        result["spans_ms"] = spans
        print("one step's phases on the GPU (ms):", " ".join(f"{n}={ms:.2f}" for n, ms in spans))
        trainer.loader.close()
    finally:
        shutdown_distributed()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
