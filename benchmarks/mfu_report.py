"""What ``benchmarks/mfu.py`` reports: one ``Result`` per measured configuration, the ``Bench``
that collects them into the JSON report (rewritten after every measurement, so a run cut short
still leaves its numbers), the printed table and the summary against issue 7's / 15's targets.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bound import fmt  # benchmarks/bound.py

T0 = time.perf_counter()  # the benchmark's start: log times and the --budget-s deadline count from here


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


@dataclass
class Result:
    key: str
    label: str
    kind: str  # baseline | megatrain
    micro_batch: int
    global_batch: int
    settings: dict[str, Any] = field(default_factory=dict)
    tokens_per_s: float | None = None
    tokens_per_s_mean: float | None = None
    step_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    mfu: float | None = None
    flops_per_token: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)  # data/forward/backward per micro-batch, optimizer/step per step
    peak_gib: float | None = None
    init_s: float | None = None
    first_step_s: float | None = None
    loss: float | None = None
    leftover_gib: float | None = None
    tokens_per_s_at_recipe_batch: float | None = None  # extrapolated, see extrapolate()
    note: str = ""
    error: str | None = None
    moe: dict[str, Any] | None = None  # MoE rows: expert load of the timed steps (load_balance)


def extrapolate(res: Result, seq_len: int, global_batch: int) -> float | None:
    """tokens/s this configuration would reach at another global batch: the measured step minus
    its optimizer phase, scaled per micro-batch, plus the optimizer phase once per step."""
    if not res.step_s or "optimizer" not in res.phases_ms:
        return None
    opt_s = res.phases_ms["optimizer"] / 1e3
    per_micro_batch = (res.step_s - opt_s) / (res.global_batch // res.micro_batch)
    step = per_micro_batch * global_batch / res.micro_batch + opt_s
    return global_batch * seq_len / step


def median_phases(per_step: list[dict[str, float]], accumulation: int) -> dict[str, float]:
    """Median phase times over the timed steps: data/forward/backward per micro-batch, the rest per step."""
    out: dict[str, float] = {}
    for name in sorted({k for p in per_step for k in p}):
        vals = [p[name] for p in per_step if name in p]
        per = 1 if name in ("optimizer", "step", "comm") else accumulation
        out[name] = statistics.median(vals) / per
    return out


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.results: list[Result] = []
        self.report: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "mode": "quick" if args.quick else "full", "config": args.config,
            "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        }
        self.deadline = T0 + args.budget_s
        self.cache: dict[tuple, Result] = {}
        self.recipe_batch: int | None = None  # the recipe's global batch (for the extrapolation)
        self.seq_len = 0

    # -- bookkeeping
    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.report["results"] = [r.__dict__ for r in self.results]
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(out)

    def add(self, result: Result) -> Result:
        if self.recipe_batch:
            result.tokens_per_s_at_recipe_batch = extrapolate(result, self.seq_len, self.recipe_batch)
        self.results.append(result)
        self.save()
        return result


def summarize(bench: Bench, defaults: list[Result], llama: bool, on_cuda: bool) -> dict[str, Any] | None:
    """The fastest baseline against the fastest default, and the issue's targets (issue 7's for
    the GPT, issue 15's for the Llama family); None without both."""
    base = [r for r in bench.results if r.kind == "baseline" and r.tokens_per_s]
    if not (base and defaults):
        return None
    b = max(base, key=lambda r: r.tokens_per_s)
    d = max(defaults, key=lambda r: r.tokens_per_s)
    return {
        "baseline": b.key, "baseline_tokens_per_s": b.tokens_per_s, "baseline_mfu": b.mfu,
        "default": d.key, "default_tokens_per_s": d.tokens_per_s, "default_mfu": d.mfu,
        "speedup": d.tokens_per_s / b.tokens_per_s,
        "at_recipe_batch": {"global_batch": bench.recipe_batch, "baseline_tokens_per_s": b.tokens_per_s_at_recipe_batch,
                            "default_tokens_per_s": d.tokens_per_s_at_recipe_batch,
                            "default_mfu": (d.tokens_per_s_at_recipe_batch * d.flops_per_token / 989.4e12
                                            if d.tokens_per_s_at_recipe_batch and d.flops_per_token and on_cuda else None),
                            "speedup": (d.tokens_per_s_at_recipe_batch / b.tokens_per_s_at_recipe_batch
                                        if d.tokens_per_s_at_recipe_batch and b.tokens_per_s_at_recipe_batch else None)},
        "targets": ({"speedup >= 1.15": d.tokens_per_s / b.tokens_per_s >= 1.15, "mfu >= 0.60": (d.mfu or 0) >= 0.60}
                    if llama else
                    {"speedup >= 1.12": d.tokens_per_s / b.tokens_per_s >= 1.12, "mfu >= 0.66": (d.mfu or 0) >= 0.66}),
    }


def print_table(bench: Bench) -> str:
    base = [r for r in bench.results if r.kind == "baseline" and r.tokens_per_s]
    best_base = max(base, key=lambda r: r.tokens_per_s) if base else None
    rb = bench.recipe_batch
    base_rb = best_base.tokens_per_s_at_recipe_batch if best_base else None
    head = (f"{'configuration':<46} {'mb':>3} {'gb':>4} {'tok/s':>8} {'MFU':>6} {'vs base':>7} {'step s':>7} "
            f"{'data':>6} {'fwd':>6} {'bwd':>6} {'opt/st':>7} {'peak GiB':>8} {'@gb' + str(rb):>9} {'vs':>6}")
    lines = [head, "-" * len(head)]
    for r in bench.results:
        if r.error:
            lines.append(f"{r.label[:46]:<46} {r.micro_batch:>3} {r.global_batch:>4}  FAILED: {r.error[:80]}")
            continue
        speed = r.tokens_per_s / best_base.tokens_per_s if (best_base and r.tokens_per_s) else None
        p = r.phases_ms
        lines.append(
            f"{r.label[:46]:<46} {r.micro_batch:>3} {r.global_batch:>4} {fmt(r.tokens_per_s, ',.0f'):>8} "
            f"{fmt(r.mfu and 100 * r.mfu, '.1f'):>5}% {fmt(speed, '.3f'):>7} {fmt(r.step_s, '.2f'):>7} "
            f"{fmt(p.get('data'), '.1f'):>6} {fmt(p.get('forward'), '.1f'):>6} {fmt(p.get('backward'), '.1f'):>6} "
            f"{fmt(p.get('optimizer'), '.1f'):>7} {fmt(r.peak_gib, '.1f'):>8} "
            f"{fmt(r.tokens_per_s_at_recipe_batch, ',.0f'):>9} "
            f"{fmt(r.tokens_per_s_at_recipe_batch / base_rb if (base_rb and r.tokens_per_s_at_recipe_batch) else None, '.3f'):>6}")
    lines.append("phases: data/fwd/bwd are ms per micro-batch, opt/st ms per optimizer step (CUDA events); "
                 "tok/s and MFU from the median step's wall time; @gb: tok/s extrapolated to the recipe's global "
                 "batch (per-micro-batch time x its micro-batches + one optimizer phase)")
    if best_base:
        lines.append(f"baseline for 'vs base': {best_base.label} ({best_base.tokens_per_s:,.0f} tok/s)")
    for key, what in (("profile", "the default"), ("profile_baseline", "the baseline"), ("profile_fp8", "megatrain FP8")):
        prof = bench.report.get(key)
        if not prof or "top_kernels" not in prof:
            continue
        lines.append("")
        lines.append(f"profile of {what} (one optimizer step of {prof['config']['micro_batches']} micro-batches of "
                     f"{prof['config']['micro_batch']}): wall {prof['wall_ms']:.0f} ms, GPU kernels "
                     f"{prof['gpu_kernel_ms']:.0f} ms, GEMM rate {fmt(prof['gemm_tflops'], '.0f')} TFLOP/s")
        lines.append("  by kind: " + ", ".join(f"{k} {v:.0f} ms ({100 * v / prof['gpu_kernel_ms']:.0f}%)"
                                              for k, v in prof["by_kind_ms"].items()))
        for k in prof["top_kernels"][:15 if key == "profile" else 8]:
            lines.append(f"  {k['ms']:8.1f} ms {100 * (k['share'] or 0):5.1f}% x{k['calls']:<4} [{k['kind'][:12]:<12}] {k['name'][:84]}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def load_balance(healths: list[dict | None]) -> dict[str, Any] | None:
    """Expert load of the timed steps from ``StepMetrics.moe`` (``moe.end_step``): max/mean tokens
    per expert, per layer; the worst layer and the layer mean, of the last step and over the steps."""
    healths = [h for h in healths if h]
    if not healths:
        return None
    per_step = [[layer["max_over_mean"] for layer in h["layers"].values()] for h in healths]
    last = healths[-1]["layers"]
    return {
        "steps": len(healths),
        "worst_layer_max_over_mean": max(per_step[-1]), "mean_layer_max_over_mean": statistics.fmean(per_step[-1]),
        "worst_over_steps": max(max(s) for s in per_step),
        "mean_over_steps": statistics.fmean(x for s in per_step for x in s),
        "per_layer_last_step": {k: round(v["max_over_mean"], 4) for k, v in last.items()},
        "entropy_last_step": {k: round(v["entropy"], 4) for k, v in last.items()},
        "aux_loss": healths[-1].get("aux_loss"), "z_loss": healths[-1].get("z_loss"),
    }
