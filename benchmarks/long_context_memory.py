"""Long-context activation memory: ``megatrain plan``'s per-term prediction against a measured
run, by checkpointing policy, and the 128k / cp=8 llama-8b prediction scaled by the measured terms.

For each sequence length and policy, a few training steps of megatrain's model
(``long_context_measure.train_steps``) measure the stored activations by part (embedding, blocks,
head and loss: the storages alive after the forward) and, on CUDA, the peak
(``torch.cuda.max_memory_allocated``) minus the states allocated before the step (parameters,
gradients, AdamW moments: this benchmark's own optimizer, not the plan's ZeRO states, so the
activation side is what is compared). Each measured term over the plan's gives a ratio; the
target recipe's prediction (default llama-8b, seq 131072, cp 8, tp 4) is then scaled term by term
by the ratios of the longest measured length. The ring attention's terms do not run on one GPU
(cp = 1): they stay unscaled, and the table says so.

    # one H200 (about 10 minutes):
    python benchmarks/long_context_memory.py --device cuda --config configs/llama-1b.yaml \\
        --seq 8192,16384,32768 --out benchmarks/results/long-context-memory-h200.json
    # CPU, tiny (seconds; the test's size):
    python benchmarks/long_context_memory.py --device cpu --tiny --out /tmp/lcm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
import torch  # noqa: E402
from long_context_measure import Measured, train_steps  # noqa: E402

from megatrain.config import load_config  # noqa: E402
from megatrain.parallel.plan import memory_plan  # noqa: E402
from megatrain.parallel.plan_activations import POLICIES, ActivationPlan, activation_plan, with_policy  # noqa: E402

GIB = 1024**3
TINY = ["model.n_layer=4", "model.seq_len=256", "train.micro_batch_size=2", "model.compile=false"]
TARGET = ["model.seq_len=131072", "train.seq_len=131072", "parallel.cp=8"]
PARTS = ("embedding", "blocks", "head")


def part_of(term: str) -> str:
    """Which measured part a plan term belongs to (the meter labels storages the same way)."""
    if term.startswith("embedding"):
        return "embedding"
    if term.startswith(("loss", "final norm")):
        return "head"
    return "blocks"


def by_part(plan: ActivationPlan) -> dict[str, float]:
    parts = dict.fromkeys(PARTS, 0.0)
    for term, value in plan.stored.items():
        parts[part_of(term)] += value
    return parts


def measure_config(args, seq: int, policy: str):
    overrides = [f"model.seq_len={max(seq, 256)}", f"train.seq_len={seq}", "model.compile=false",
                 f"train.dtype={args.dtype}", *args.override]
    cfg = with_policy(load_config(args.config, [*(TINY if args.tiny else []), *overrides]), policy, args.every_n)
    return cfg


def row(args, seq: int, policy: str, device: torch.device) -> dict:
    """One measured (seq, policy): plan and measurement, by part, with their ratios."""
    cfg = measure_config(args, seq, policy)
    reference = device.type == "cpu"  # the kernels that run there (auto: reference on a CPU)
    plan = activation_plan(cfg, reference=reference)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    start = time.perf_counter()
    try:
        m: Measured = train_steps(cfg, device, dtype, steps=args.steps)
    except torch.OutOfMemoryError as exc:
        return {"seq": seq, "policy": policy, "error": f"out of memory: {str(exc).splitlines()[0]}"}
    except Exception as exc:  # noqa: BLE001 - one row's failure is that row's result; the others still run
        return {"seq": seq, "policy": policy, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    predicted = by_part(plan)
    out = {"seq": seq, "policy": policy, "seconds": round(time.perf_counter() - start, 1),
           "predicted_stored": predicted, "measured_stored": {p: m.stored.get(p, 0) for p in PARTS},
           "predicted_stored_bytes": plan.stored_bytes, "measured_stored_bytes": m.stored_bytes,
           "predicted_working_bytes": plan.working_bytes, "loss": m.losses[-1]}
    out["ratio"] = {p: (out["measured_stored"][p] / v if v else None) for p, v in predicted.items()}
    out["ratio"]["stored"] = m.stored_bytes / plan.stored_bytes
    if m.peak_bytes is not None:  # the activation side of the peak: what the step added to the states
        out["measured_peak_bytes"], out["measured_states_bytes"] = m.peak_bytes, m.states_bytes
        measured_activations = m.peak_bytes - m.states_bytes
        out["measured_activation_peak_bytes"] = measured_activations
        out["ratio"]["peak"] = measured_activations / plan.total_bytes
        out["ratio"]["working"] = (measured_activations - m.stored_bytes) / plan.working_bytes if plan.working_bytes else None
    return out


def scaled_target(args, rows: list[dict]) -> dict:
    """The target recipe's plan per policy, each part scaled by the measured ratio of the longest
    length that ran (ring terms: no ratio, cp = 1 here)."""
    cfg = load_config(args.target_config, [*TARGET, *args.target_override])
    base = memory_plan(cfg, args.target_world_size)
    result = {"config": args.target_config, "overrides": [*TARGET, *args.target_override],
              "world_size": base.world_size, "states_bytes": base.states_bytes, "policies": {}}
    for policy in POLICIES:
        done = [r for r in rows if r["policy"] == policy and "error" not in r]
        plan = base.activations[policy]
        if not done:
            continue
        ratio = max(done, key=lambda r: r["seq"])["ratio"]
        parts = by_part(plan)
        scaled = sum(v * (ratio[p] if ratio.get(p) else 1.0) for p, v in parts.items())
        working = plan.working_bytes * (ratio.get("working") or 1.0)
        result["policies"][policy] = {
            "predicted_bytes": base.peak_bytes(policy), "predicted_stored_bytes": plan.stored_bytes,
            "predicted_working_bytes": plan.working_bytes, "scaled_bytes": base.states_bytes + scaled + working,
            "unscaled_ring_bytes": sum(v for k, v in plan.working.items() if k.startswith("ring")),
        }
    return result


def table(rows: list[dict], target: dict) -> str:
    lines = ["| seq | policy | stored predicted GiB | stored measured GiB | blocks ratio | head ratio | "
             "activation peak predicted GiB | measured GiB | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['policy']} | {r['error']} | | | | | | |")
            continue
        peak = r.get("measured_activation_peak_bytes")
        predicted_peak = r["predicted_stored_bytes"] + r["predicted_working_bytes"]
        lines.append(
            f"| {r['seq']} | {r['policy']} | {r['predicted_stored_bytes'] / GIB:.4f} | {r['measured_stored_bytes'] / GIB:.4f} "
            f"| {fmt(r['ratio']['blocks'])} | {fmt(r['ratio']['head'])} | {predicted_peak / GIB:.4f} "
            f"| {'-' if peak is None else f'{peak / GIB:.4f}'} | {fmt(r['ratio'].get('peak'))} |")
    lines += ["", f"{target['config']} {' '.join(target['overrides'])} (world {target['world_size']}), per GPU:",
              "| policy | plan GiB | scaled by the measured ratios GiB | of which ring working set (unscaled) GiB |",
              "|---|---|---|---|"]
    for policy, t in target["policies"].items():
        lines.append(f"| {policy} | {t['predicted_bytes'] / GIB:.2f} | {t['scaled_bytes'] / GIB:.2f} "
                     f"| {t['unscaled_ring_bytes'] / GIB:.2f} |")
    return "\n".join(lines)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="configs/llama-1b.yaml")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer, 256-token version of --config (CPU)")
    ap.add_argument("--seq", default="8192,16384,32768", help="comma-separated sequence lengths")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--every-n", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32 (default on CPU)")
    ap.add_argument("--override", nargs="*", default=[], help="more overrides of the measured config")
    ap.add_argument("--target-config", default="configs/llama-8b.yaml")
    ap.add_argument("--target-override", nargs="*", default=[])
    ap.add_argument("--target-world-size", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    rows: list[dict] = []
    for seq in (int(x) for x in args.seq.split(",")):
        for policy in args.policies.split(","):
            rows.append(row(args, seq, policy, device))
            print(json.dumps({k: rows[-1].get(k) for k in ("seq", "policy", "ratio", "error")}), flush=True)
            write(args, device, rows, None)  # a run cut short keeps the rows it measured
    target = scaled_target(args, rows)
    print(table(rows, target))
    write(args, device, rows, target)
    return 0


def write(args, device: torch.device, rows: list[dict], target: dict | None) -> None:
    if not args.out:
        return
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "config": args.config, "tiny": args.tiny, "dtype": args.dtype,
              "rows": rows, "target": target}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
