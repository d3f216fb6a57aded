"""FP8 rows of benchmarks/mfu.py (issue 16): in one process, on the recipe's shape and batch,

    (a) the bf16 baseline: mfu.py's nanoGPT (nanogpt_baseline.py) + whole-model torch.compile
        (its "baseline" part);
    (b) the same baseline with torchao float8 tensorwise on every Linear but the LM head, then
        torch.compile: the standard FP8 recipe a user adds in two lines ("fp8" part, here);
    (c) megatrain's default in bf16 (mfu.py's "default" part);
    (d) megatrain FP8: the default with ``train.precision=fp8`` (here), plus ``--fp8-variants``;

then a profile of (d) (GPU time by kernel: which casts cost what) and bound.py's FP8 GEMM
speed of light. ``summary()`` prints tokens/s, MFU against the dense bf16 peak (989.4 TFLOP/s,
the number everyone quotes) and, separately labelled, against the dense FP8 peak (1978.9),
step phases, peak memory and the issue's two ratios: (d)/(a) >= 1.25 and (d)/(b) >= 1.10.

    python benchmarks/mfu.py --quick --only baseline,default,fp8,profile --baseline-mbs 16 --default-mbs 16
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn
from bound import FP8_PEAK_FLOPS, fmt, fp8_gemm_bound

BF16_PEAK_FLOPS = 989.4e12

# --fp8-variants: extra megatrain FP8 rows (config overrides; "mbN" changes the micro-batch)
VARIANTS: dict[str, list[str]] = {
    "rowwise": ["train.fp8.recipe=rowwise"],
    "keep-ends": ["train.fp8.keep_first_block=true", "train.fp8.keep_last_block=true"],
    "pow2": ["train.fp8.round_scales_to_power_of_2=true"],
    "serial": ["model.block=serial"],
    "gelu-ref": ["model.kernels.gelu=reference"],  # inductor's bias + GeLU, fused with the FP8 cast's amax
    "ln-fused": ["model.kernels.layernorm=fused"],
    "once": ["train.fp8.casts=once"],  # each activation cast once, the FP8 copy reused by the backward
    "fused": ["train.fp8.casts=fused"],  # once, + the GeLU output's amax and cast in Triton (fp8_gelu_triton.py)
    "torchao-casts": ["train.fp8.casts=torchao"],  # each Float8Linear casts its own input, twice
}


def torchao_tensorwise(model: nn.Module) -> None:
    """(b): what torchao's README does to a GPT: every Linear but the LM head to Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda _module, fqn: "lm_head" not in fqn)


def run(bench, *, baseline: Callable[..., Any], megatrain_row: Callable[[str, str, list[str], int], Any],
        profile: Callable[[list[str]], Any], bound: Callable[[], Any], recipe_mb: int, variants: list[str],
        with_baseline: bool = True, with_bound: bool = True) -> None:
    """Rows (b) (with the baseline part) and (d) (and the variants), then the profile of the
    fastest FP8 row and the FP8 GEMM bound."""
    if with_baseline:
        baseline(recipe_mb, convert=torchao_tensorwise, key="baseline-fp8",
                 label="baseline + torchao float8 tensorwise + compile",
                 precision="torchao float8 tensorwise (every Linear but lm_head), fp32 weights, bf16 autocast")
    rows = [(megatrain_row(f"fp8-mb{recipe_mb}", f"megatrain FP8 (tensorwise), mb {recipe_mb}", ["train.precision=fp8"],
                           recipe_mb), ["train.precision=fp8"])]
    for name in variants:
        mb = int(name[2:]) if name.startswith("mb") else recipe_mb
        overrides = ["train.precision=fp8", *VARIANTS.get(name, [])]
        rows.append((megatrain_row(f"fp8-mb{recipe_mb}-{name}", f"megatrain FP8, {name}, mb {mb}", overrides, mb), overrides))
    measured = [(r, o) for r, o in rows if r is not None and r.tokens_per_s and not r.error]
    fastest = max(measured, key=lambda ro: ro[0].tokens_per_s)[1] if measured else ["train.precision=fp8"]
    bench.report["profile_fp8_overrides"] = fastest
    profile(fastest)
    if with_bound:
        bound()


def gemm_bound(bench, model_cfg, micro_batch: int, device, log: Callable[[str], None]) -> None:
    """bound.py's FP8 GEMMs (blocks in FP8, LM head in bf16) beside the same GEMMs in bf16."""
    if device.type != "cuda":
        return
    b = fp8_gemm_bound(model_cfg, micro_batch, device)
    b["fp8_gemms_only_tokens_per_s"] = b["tokens"] / b["fp8_ms"] * 1e3
    b["bf16_gemms_only_tokens_per_s"] = b["tokens"] / b["bf16_ms"] * 1e3
    bench.report["fp8_bound"] = b
    bench.save()
    log(f"fp8 bound: a micro-batch's GEMMs (blocks FP8, head bf16) {b['fp8_ms']:.1f} ms ({b['fp8_tflops']:.0f} TFLOP/s, "
        f"{fmt(b['fp8_power_w'], '.0f')} W, {fmt(b['fp8_sm_mhz'], '.0f')} MHz) vs all-bf16 {b['bf16_ms']:.1f} ms "
        f"({b['bf16_tflops']:.0f} TFLOP/s, {fmt(b['bf16_power_w'], '.0f')} W): {b['speedup']:.2f}x")


def _best(results: list, prefix: str):
    rows = [r for r in results if r.key.startswith(prefix) and r.tokens_per_s and not r.error]
    return max(rows, key=lambda r: r.tokens_per_s) if rows else None


def summary(bench) -> dict[str, Any]:
    """The four rows (best micro-batch of each), both MFUs and the issue's ratios; prints a table."""
    results = bench.results
    rows = {"a": _best([r for r in results if r.kind == "baseline"], "baseline-mb"),
            "b": _best(results, "baseline-fp8-mb"), "c": _best(results, "default-mb"), "d": _best(results, "fp8-mb")}
    a, b = rows["a"], rows["b"]
    head = (f"{'row':<3} {'configuration':<52} {'tok/s':>8} {'MFU bf16pk':>10} {'MFU fp8pk':>9} {'vs (a)':>6} "
            f"{'vs (b)':>6} {'step s':>6} {'fwd':>6} {'bwd':>6} {'opt':>6} {'GiB':>6}")
    lines = [head, "-" * len(head)]
    out: dict[str, Any] = {"rows": {}}
    for name, r in rows.items():
        if r is None:
            lines.append(f"({name}) missing (skipped or failed)")
            continue
        flops = r.tokens_per_s * r.flops_per_token if r.flops_per_token and r.mfu is not None else None  # GPU only
        mfu_bf16 = flops / BF16_PEAK_FLOPS if flops else None
        mfu_fp8 = flops / FP8_PEAK_FLOPS if flops else None
        vs_a = r.tokens_per_s / a.tokens_per_s if a else None
        vs_b = r.tokens_per_s / b.tokens_per_s if b else None
        p = r.phases_ms
        lines.append(f"({name}) {r.label[:52]:<52} {r.tokens_per_s:>8,.0f} {fmt(mfu_bf16 and 100 * mfu_bf16, '.1f'):>9}% "
                     f"{fmt(mfu_fp8 and 100 * mfu_fp8, '.1f'):>8}% {fmt(vs_a, '.3f'):>6} {fmt(vs_b, '.3f'):>6} "
                     f"{r.step_s:>6.2f} {fmt(p.get('forward'), '.0f'):>6} {fmt(p.get('backward'), '.0f'):>6} "
                     f"{fmt(p.get('optimizer'), '.0f'):>6} {fmt(r.peak_gib, '.1f'):>6}")
        out["rows"][name] = {"key": r.key, "tokens_per_s": r.tokens_per_s, "mfu_bf16_peak": mfu_bf16,
                             "mfu_fp8_peak": mfu_fp8, "vs_a": vs_a, "vs_b": vs_b, "peak_gib": r.peak_gib}
    d = rows["d"]
    if d and a and b:
        out["targets"] = {"d/a >= 1.25": d.tokens_per_s / a.tokens_per_s >= 1.25,
                          "d/b >= 1.10": d.tokens_per_s / b.tokens_per_s >= 1.10}
        lines.append(f"targets: (d)/(a) = {d.tokens_per_s / a.tokens_per_s:.3f} (>= 1.25), "
                     f"(d)/(b) = {d.tokens_per_s / b.tokens_per_s:.3f} (>= 1.10)")
    lines.append("MFU bf16pk: model FLOPs over the dense bf16 peak (989.4 TFLOP/s); MFU fp8pk: the same FLOPs over "
                 "the dense FP8 peak (1978.9 TFLOP/s); fwd/bwd ms per micro-batch, opt ms per step")
    bound = bench.report.get("fp8_bound")
    if bound:
        lines.append(f"FP8 GEMM bound (bound.py): a micro-batch of {bound['tokens']} tokens' GEMMs take {bound['fp8_ms']:.1f} ms "
                     f"in FP8 (blocks; head bf16) vs {bound['bf16_ms']:.1f} ms in bf16 ({bound['speedup']:.2f}x; "
                     f"{fmt(bound['fp8_power_w'], '.0f')} vs {fmt(bound['bf16_power_w'], '.0f')} W)")
    text = "\n".join(lines)
    print(text, flush=True)
    out["table"] = text
    return out
