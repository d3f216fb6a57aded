"""What ``benchmarks/parallel.py`` reports, from the ranks' ``rank<N>.json`` files.

Per configuration it reports: tokens/s (global and per GPU) from the synchronised wall clock
over the steps after ``WARMUP`` (compile and the first DeepSpeed step are excluded), MFU by the
trainer's formula (6N + 12 L d s per token, over 989.4 TFLOP/s times the world size), the
trainer's per-phase GPU times (CUDA events), peak memory per rank, and the loss of each step.

Derived: DP2 weak-scaling efficiency (per-GPU tokens/s of dp2 over dp1, both at the recipe's
micro-batch with no accumulation: a gradient reduction and an optimizer step every micro-batch,
the hardest case); the gain of each overlap (DP all-reduce/overlap_comm, TP chunks 1/2/4,
sequence parallelism, pipeline micro-batches); and the largest |loss difference| of each
TP2/PP2 run against the one-GPU run of the same global batch (32 samples: 4 accumulated
micro-batches of 8) over the same steps (20 for the defaults), which must stay within
``LOSS_TOLERANCE`` (bf16; see ``compare_losses``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

from parallel_configs import CONFIGS, GAINS, LOSS_PAIRS, LOSS_TOLERANCE, WARMUP

ROOT = Path(__file__).resolve().parents[1]


def summarize(name: str, work_dir: Path) -> dict | None:
    """One configuration's numbers from its ranks' files."""
    ranks = [json.loads(p.read_text()) for p in sorted((work_dir / name).glob("rank*.json"))]
    if not ranks:
        errors = [p.read_text()[-1500:] for p in sorted((work_dir / name).glob("error-rank*.txt"))]
        if errors:
            print(f"--- {name} failed:\n{errors[0]}", flush=True)
        return None
    r0 = ranks[0]
    world, tokens_per_step = r0["world_size"], r0["tokens_per_step"]
    steps = r0["steps"]
    timed = steps[WARMUP:] if len(steps) >= WARMUP + 3 else steps[1:]
    # a step ends when the slowest rank has synchronised: take the max over ranks per step
    walls = [max(r["steps"][i]["wall_s"] for r in ranks) for i in range(len(steps))][len(steps) - len(timed):]
    step_s = statistics.mean(walls)
    tokens_per_s = tokens_per_step / step_s
    peak = r0["peak_flops_per_gpu"]
    phase_names = sorted({k for r in ranks for s in r["steps"] for k in s["phases_ms"]})
    phases = {}
    for phase in phase_names:  # the mean over timed steps of the slowest rank's phase time
        per_step = [max(r["steps"][i]["phases_ms"].get(phase, 0.0) for r in ranks)
                    for i in range(len(steps) - len(timed), len(steps)) if any(r["steps"][i]["phases_ms"] for r in ranks)]
        if per_step:
            phases[phase] = statistics.mean(per_step)
    # the loss every rank reports is the global batch's; the last pipeline stage computes it
    loss_rank = max(ranks, key=lambda r: r["coords"]["pp"])
    return {
        "name": name, "what": CONFIGS[name].what if name in CONFIGS else "", "world_size": world,
        "layout": r0["layout"], "grad_accumulation": r0["grad_accumulation"], "tokens_per_step": tokens_per_step,
        "steps": len(steps), "timed_steps": len(timed), "step_s": step_s, "step_s_stdev": statistics.pstdev(walls),
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world,
        "mfu": tokens_per_s * r0["flops_per_token"] / (peak * world) if peak else None,
        "trainer_tokens_per_s_median": statistics.median(s["trainer_tokens_per_s"] for s in timed),
        "phases_ms": phases,
        "peak_allocated_gib": [r.get("peak_allocated_gib") for r in ranks],
        "peak_reserved_gib": [r.get("peak_reserved_gib") for r in ranks],
        "build_s": max(r["build_s"] for r in ranks), "losses": [s["loss"] for s in loss_rank["steps"]],
        "device": r0["device"], "overrides": r0["overrides"], "env": r0["env"],
        "per_rank": [{"rank": r["rank"], "wall_s": [s["wall_s"] for s in r["steps"]],
                      "trainer_step_time_s": [s["trainer_step_time_s"] for s in r["steps"]],
                      "build_s": r["build_s"]} for r in ranks],
    }


def compare_losses(results: dict[str, dict]) -> list[dict]:
    """Largest |loss difference| per step against the one-GPU run of the same global batch.

    Tolerance (bf16): the runs share seed, data and global batch, but TP splits every GEMM's
    reduction (row-parallel partial sums are rounded to bf16 before the cross-rank sum) and the
    pipeline/accumulation order differs, so logits differ by O(bf16 eps = 2^-8 ~ 4e-3) relative
    in places; the mean cross-entropy over 65k tokens averages most of that out, and the updates
    (LAMB, fp32 master weights) then move the runs apart slowly. 2e-2 absolute on a loss of
    ~7-11 is ~0.2%: far below the loss change over these steps, far above a bug (a wrong shard,
    a missing reduction or a double-counted gradient shows up as >1e-1 within a few steps)."""
    rows = []
    for run, ref in LOSS_PAIRS:
        if run not in results or ref not in results:
            continue
        a, b = results[run]["losses"], results[ref]["losses"]
        n = min(len(a), len(b))
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
        worst = max(range(n), key=lambda i: diffs[i])
        rows.append({"run": run, "reference": ref, "steps": n, "max_abs_diff": diffs[worst], "at_step": worst + 1,
                     "mean_abs_diff": statistics.mean(diffs), "tolerance": LOSS_TOLERANCE,
                     "within": diffs[worst] <= LOSS_TOLERANCE, "first_loss": b[0], "last_loss": b[n - 1]})
    return rows


def derived(results: dict[str, dict]) -> dict:
    out: dict = {"gains": []}
    if "dp1" in results and "dp2" in results:
        out["dp2_weak_scaling_efficiency"] = results["dp2"]["tokens_per_s_per_gpu"] / results["dp1"]["tokens_per_s_per_gpu"]
    for other in ("dp2-nooverlap", "dp2-again", "dp2-z1", "dp2-z1-nooverlap", "dp4", "dp4-nooverlap", "dp8", "dp8-nooverlap"):
        if "dp1" in results and other in results:
            out[f"{other}_weak_scaling_efficiency"] = (
                results[other]["tokens_per_s_per_gpu"] / results["dp1"]["tokens_per_s_per_gpu"])
    if "dp1-gb32" in results and "dp2-gb32" in results:  # same global batch: half the accumulation per GPU
        out["dp2_gb32_strong_scaling_efficiency"] = (
            results["dp2-gb32"]["tokens_per_s_per_gpu"] / results["dp1-gb32"]["tokens_per_s_per_gpu"])
    for what, on, off in GAINS:
        if on in results and off in results:
            out["gains"].append({"what": what, "on": on, "off": off,
                                 "gain": results[on]["tokens_per_s"] / results[off]["tokens_per_s"] - 1,
                                 "step_ms_on": 1e3 * results[on]["step_s"], "step_ms_off": 1e3 * results[off]["step_s"]})
    out["losses"] = compare_losses(results)
    return out


def print_table(results: dict[str, dict], extra: dict) -> None:
    print("\nconfig          world acc  step ms (sd)    tokens/s  tok/s/GPU    MFU   peak GiB/GPU      phases ms (slowest rank)")
    for r in results.values():
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   n/a"
        mem = "/".join(f"{m:.1f}" for m in r["peak_allocated_gib"] if m is not None) or "n/a"
        phases = " ".join(f"{k[:4]} {v:.0f}" for k, v in r["phases_ms"].items())
        print(f"{r['name']:15s} {r['world_size']:5d} {r['grad_accumulation']:3d} {1e3 * r['step_s']:8.1f} "
              f"({1e3 * r['step_s_stdev']:4.1f}) {r['tokens_per_s']:10.0f} {r['tokens_per_s_per_gpu']:10.0f} {mfu} "
              f"{mem:>14s}   {phases}")
    for key, value in extra.items():
        if key.endswith("scaling_efficiency"):
            print(f"{key}: {100 * value:.1f}%")
    for g in extra["gains"]:
        print(f"gain {g['what']}: {100 * g['gain']:+.1f}% ({g['step_ms_off']:.1f} -> {g['step_ms_on']:.1f} ms/step)")
    for c in extra["losses"]:
        print(f"loss {c['run']} vs {c['reference']}: max |diff| {c['max_abs_diff']:.2e} at step {c['at_step']} "
              f"(mean {c['mean_abs_diff']:.1e}, {c['steps']} steps, loss {c['first_loss']:.3f} -> {c['last_loss']:.3f}) "
              f"{'within' if c['within'] else 'OUTSIDE'} {c['tolerance']:.0e}")


def machine_info(args) -> dict:
    info = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "label": args.label}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    try:
        info["nvidia_smi_topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                                 timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    info["config_sha256"] = hashlib.sha256((ROOT / args.config).read_bytes()).hexdigest()[:16]
    return info
