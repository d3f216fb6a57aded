"""Data loader throughput, and how long a training step waits for data with prefetch on vs off.

    python benchmarks/data_loader.py [--out runs/bench/data_loader.json] [--source-bytes 4000000]

1. Shards the first ``--source-bytes`` of the standard library (offline everywhere) at two
   sequence lengths, BPE vocabulary 8192, into a temporary directory (the time is reported).
2. Loader throughput: tokens/s of ``next(loader)`` alone, synchronous and with prefetch.
3. A simulated training step of fixed duration: ``sleep`` (a GPU step: the CPU is free) and a
   torch matmul (a CPU step: the prefetch thread competes for the cores). For each, the mean
   time per step spent waiting in ``next(loader)``, with prefetch_batches 0 and 4.
Prints a table; writes every number as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from megatrain.config import DataConfig  # noqa: E402
from megatrain.data.loader import build_loader  # noqa: E402
from megatrain.data.shard import shard_corpus  # noqa: E402

VOCAB = 8192
MICRO_BATCH = 8


def throughput(index, prefetch: int, batches: int) -> float:
    loader = build_loader(index, micro_batch_size=MICRO_BATCH, dp_rank=0, dp_size=1, seed=0,
                          prefetch_batches=prefetch, shuffle_shards=4)
    next(loader)  # thread start and first shard read are not steady state
    started, tokens = time.perf_counter(), 0
    for _ in range(batches):
        inputs, _ = next(loader)
        tokens += inputs.numel()
    elapsed = time.perf_counter() - started
    loader.close()
    return tokens / elapsed


def matmul_step(duration_s: float) -> callable:
    """A matmul loop calibrated to take about ``duration_s`` (median of 5 timed calibrations)."""
    a = torch.randn(384, 384)
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10):
            a @ a
        timings.append((time.perf_counter() - started) / 10)
    repeats = max(1, round(duration_s / sorted(timings)[2]))
    return lambda: [a @ a for _ in range(repeats)]


def step_wait(index, prefetch: int, steps: int, step_fn) -> dict:
    # Windows of one shard: a shard is read, verified and decoded every samples_per_shard / 8
    # steps, the steady state of a corpus much larger than memory.
    loader = build_loader(index, micro_batch_size=MICRO_BATCH, dp_rank=0, dp_size=1, seed=0,
                          prefetch_batches=prefetch, shuffle_shards=1)
    next(loader)
    waits, started = [], time.perf_counter()
    for _ in range(steps):
        before = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - before)
        step_fn()
    total = time.perf_counter() - started
    loader.close()
    return {"wait_ms_mean": 1e3 * sum(waits) / steps, "wait_ms_max": 1e3 * max(waits), "step_ms": 1e3 * total / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench/data_loader.json")
    parser.add_argument("--source-bytes", type=int, default=3_000_000)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args(argv)

    result: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                    "args": vars(args), "sharding": [], "throughput": [], "step_wait": []}
    with tempfile.TemporaryDirectory() as root:
        indexes = {}
        for seq_len in (128, 2048):
            cfg = DataConfig(sources=["stdlib"], max_source_bytes=args.source_bytes, shard_url=root,
                             samples_per_shard=max(64, 262144 // seq_len))
            started = time.perf_counter()
            indexes[seq_len] = index = shard_corpus(cfg, seq_len, VOCAB)
            result["sharding"].append({"seq_len": seq_len, "seconds": time.perf_counter() - started,
                                       "samples": index.num_samples, "shards": len(index.shards), "tokens": index.num_tokens})

        print(f"sharding {args.source_bytes / 1e6:.1f} MB of stdlib, vocab {VOCAB}:")
        for row in result["sharding"]:
            print(f"  seq_len {row['seq_len']:>5}: {row['seconds']:6.1f} s, {row['tokens']:>9} tokens in {row['shards']} shards")

        print(f"\nloader throughput, micro-batch {MICRO_BATCH} (tokens/s of next() alone):")
        print(f"  {'seq_len':>7} {'prefetch 0':>14} {'prefetch 4':>14}")
        for seq_len, index in indexes.items():
            batches = args.batches if seq_len <= 128 else max(20, args.batches // 4)
            rates = {p: throughput(index, p, batches) for p in (0, 4)}
            result["throughput"].append({"seq_len": seq_len, "tokens_per_s": {str(p): r for p, r in rates.items()}})
            print(f"  {seq_len:>7} {rates[0]:>14,.0f} {rates[4]:>14,.0f}")

        index = indexes[2048]
        step_s = args.step_ms / 1e3
        kinds = {"sleep": lambda: time.sleep(step_s), "matmul": matmul_step(step_s)}
        print(f"\nsimulated step of ~{args.step_ms:.0f} ms, seq_len 2048, micro-batch {MICRO_BATCH}: time waiting for data")
        print(f"  {'step':>7} {'prefetch':>8} {'wait ms/step':>13} {'max wait ms':>12} {'step ms':>8}")
        for kind, fn in kinds.items():
            for prefetch in (0, 4):
                row = {"step": kind, "prefetch": prefetch, **step_wait(index, prefetch, args.steps, fn)}
                result["step_wait"].append(row)
                print(f"  {kind:>7} {prefetch:>8} {row['wait_ms_mean']:>13.3f} {row['wait_ms_max']:>12.2f}"
                      f" {row['step_ms']:>8.1f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
