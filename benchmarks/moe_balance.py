"""Expert-load balance of a real MoE training run, window by window: the worst layer's max/mean
token load per step (1.0 = every expert equally loaded; top_k / n_experts x E is every token on one
expert), the mean over layers, and the loss, from the run's ``metrics.jsonl``.

The run is the trainer itself, e.g. the GPU recipe on real text with a global batch that one GPU
steps through in about half a second (``benchmarks/results/moe-balance-2b-h100.json`` was made so):

    python -m megatrain.train --config configs/moe-gpu-2b.yaml train.device=cuda train.steps=2000 \\
        train.micro_batch_size=8 train.global_batch_size=32 optim.warmup_steps=100 \\
        data.max_source_bytes=16000000 train.run_dir=runs/moe-balance
    python benchmarks/moe_balance.py runs/moe-balance/metrics.jsonl --name aux_loss --out balance.json

Several runs (``--name`` per file) go into one table and one JSON. ``--pool N`` first adds up the
token shares of N consecutive steps, as one step of an N-times larger global batch would count them
(the recipe's 512 x 2048 tokens is 16 steps of the run above).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from megatrain.report.runs import final_rows, read_jsonl  # noqa: E402


def windows(rows: list[dict], size: int) -> list[dict]:
    """One summary per ``size`` steps: medians of the worst layer's and the layers' mean max/mean."""
    out = []
    last = rows[-1]["step"] if rows else 0
    for start in range(0, last, size):
        chunk = [r for r in rows if start < r["step"] <= start + size]
        if not chunk:
            continue
        worst = [r["moe"]["max_over_mean"] for r in chunk]
        mean = [statistics.mean(layer["max_over_mean"] for layer in r["moe"]["layers"].values()) for r in chunk]
        # each layer's median over the window: is one layer the outlier (the first layer routes by
        # token identity alone), or are they all short of balance?
        per_layer = {name: round(statistics.median(r["moe"]["layers"][name]["max_over_mean"] for r in chunk), 3)
                     for name in chunk[0]["moe"]["layers"]}
        out.append({"steps": [start + 1, start + size], "worst_layer_median": round(statistics.median(worst), 3),
                    "worst_layer_max": round(max(worst), 3), "layer_mean_median": round(statistics.median(mean), 3),
                    "layer_medians": per_layer, "loss_last": round(chunk[-1]["loss"], 4),
                    "step_s_median": round(statistics.median(r["step_time_s"] for r in chunk), 4)})
    return out


def read_rows(path: Path, parser: argparse.ArgumentParser) -> list[dict]:
    """metrics.jsonl's rows as the run finally happened (``report.runs``: a step redone after a
    restart or rollback counts once); a last line cut short (a run killed mid-write) is left out,
    a bad line before it is an error naming the line."""
    found = read_jsonl(path)
    if not found.exists:
        parser.error(f"{path}: no such file")
    cut = found.torn[-1] if found.ends_torn else None
    bad = [number for number in found.torn if number != cut]
    if bad:
        parser.error(f"{path}: line {bad[0]} is not JSON")
    if cut is not None:
        print(f"{path}: line {cut} is cut short (a run killed while writing it): left out", file=sys.stderr)
    return final_rows(found.rows)


def pooled(rows: list[dict], n: int) -> list[dict]:
    """Rows of n consecutive steps each, their shares added up (max/mean recomputed per layer)."""
    out = []
    for start in range(0, len(rows) - n + 1, n):
        chunk = rows[start:start + n]
        layers = {}
        for layer in chunk[0]["moe"]["layers"]:
            load = [sum(values) for values in zip(*(r["moe"]["layers"][layer]["share"] for r in chunk))]
            layers[layer] = {"max_over_mean": max(load) * len(load) / sum(load)}  # what windows() reads
        out.append({"step": chunk[-1]["step"], "loss": chunk[-1]["loss"],
                    "step_time_s": sum(r["step_time_s"] for r in chunk),
                    "moe": {"layers": layers, "max_over_mean": max(v["max_over_mean"] for v in layers.values())}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl of MoE runs")
    parser.add_argument("--name", nargs="*", default=None, help="a label per file (default: its folder)")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--pool", type=int, default=1, help="add up the shares of this many steps first")
    parser.add_argument("--out", default=None, help="write the summaries here as JSON")
    args = parser.parse_args(argv)
    names = args.name or [Path(p).parent.name for p in args.metrics]
    if len(names) != len(args.metrics):
        parser.error(f"{len(names)} names for {len(args.metrics)} files")
    report = {}
    print("| run | steps | worst layer max/mean (median) | worst (max) | layer mean | highest layer median | loss |")
    print("|---|---|---|---|---|---|---|")
    for name, path in zip(names, args.metrics):
        rows = [row for row in read_rows(Path(path), parser) if row.get("moe")]
        if not rows:
            parser.error(f"{path}: no MoE rows (model.mlp=moe writes a 'moe' entry per step)")
        report[name] = windows(pooled(rows, args.pool) if args.pool > 1 else rows, args.window)
        for w in report[name]:
            top = max(w["layer_medians"], key=w["layer_medians"].get)
            print(f"| {name} | {w['steps'][0]}-{w['steps'][1]} | {w['worst_layer_median']:.3f} | "
                  f"{w['worst_layer_max']:.3f} | {w['layer_mean_median']:.3f} | "
                  f"layer {top}: {w['layer_medians'][top]:.3f} | {w['loss_last']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
