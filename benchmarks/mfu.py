"""MFU benchmark (issue 7): megatrain's real training step against a standard PyTorch GPT of the
same shape, in one process, on one GPU, both fed by megatrain's real data pipeline. For a Llama
recipe (``--config configs/llama-1b.yaml``, issue 15) the baseline is Hugging Face's
``LlamaForCausalLM`` of the same shape (``llama_baseline.py``); use ``--only`` without
``ablation`` (its rows are the GPT's).

    python benchmarks/mfu.py --quick --out runs/mfu.json          # under 8 minutes on one H200
    python benchmarks/mfu.py --out runs/mfu.json                  # longer steps, more micro-batches
    python benchmarks/mfu.py --quick --config configs/tiny-cpu.yaml --device cpu   # smoke test
    python benchmarks/mfu.py --quick --config configs/moe-gpu-2b.yaml             # MoE (mfu_moe.py, issue 32)

What runs, in order of priority (a time budget skips what no longer fits; JSON is rewritten after
every measurement, so a run cut short still leaves its numbers):

1. ceilings: a bf16 8192^3 matmul and a device-to-device copy, and the model's GEMM shapes alone;
   with ``--only ...,bound`` also ``bound.py``'s speed of light of a micro-batch (after 2);
2. the baseline: a nanoGPT-style GPT (``nanogpt_baseline.py``; serial pre-LN blocks, SDPA causal attention,
   tanh GeLU MLP, tied LM head with full logits + F.cross_entropy, fp32 weights under bf16
   autocast, fused AdamW, global grad-norm clip, whole-model ``torch.compile``), at each
   micro-batch of ``--baseline-mbs``, fed by ``megatrain.data.loader`` from webdataset shards
   on local disk (``shard_corpus`` on the standard library's source, sharded in a background
   process while the baseline compiles);
3. megatrain's default: ``megatrain.training.trainer.Trainer`` built from the recipe (DeepSpeed engine,
   bf16, real loader) and ``trainer.train_step()`` called repeatedly, at each of
   ``--default-mbs``;
4. a ``torch.profiler`` trace of two micro-batches of the default: GPU time by kernel and by
   kind (GEMM, attention, Triton, ...);
5. the ablation in MegaScale's Table 3 order, each row one Trainer: a serial (baseline-equivalent)
   block with reference kernels and AdamW -> parallel block -> sliding window -> fused kernels
   -> compile (four projections) -> fused projections (PaLM) -> LAMB at a 4x larger batch.
   The window and the fused projections are carried into later rows only if they made their
   row faster; an A/B row runs the default with the fused projections too;
6. extras: the default with ZeRO-1, and with a sliding window under compile.

Timing: every configuration runs warm-up steps first (compilation happens there), then timed
steps. A step is one optimizer step over the global batch; its time is the host wall clock of
``train_step()`` (which ends in ``loss.item()``, so the GPU has finished it). tokens/s = global
batch x seq_len / step time (median over timed steps); MFU by ``megatrain.observe.mfu`` (6N +
12 L d s_attended per token over the device's dense bf16 peak). Phase times are CUDA-event times
from ``megatrain.observe.timers.StepTimers`` (the trainer's own; the baseline loop uses the
same class), reported per micro-batch (data, forward, backward) and per step (optimizer).
Peak memory is ``torch.cuda.max_memory_allocated`` of each configuration.

The baseline and the LAMB/default rows run at the same global batch (``--large-batch``); the
ablation rows before LAMB at a quarter of it (``--small-batch``), as MegaScale's table does.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere in the repo
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from bound import fmt  # noqa: E402  (benchmarks/bound.py)
from mfu_baseline import run_baseline  # noqa: E402
from mfu_data import Data  # noqa: E402
from mfu_device import measure_ceilings  # noqa: E402
from mfu_megatrain import MODEL_CHANGES, VARIANTS, Spec, build_config, run_megatrain, variant_spec  # noqa: E402
from mfu_profile import run_profile  # noqa: E402
from mfu_report import T0, Bench, Result, log, print_table, summarize  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt-1.3b.yaml")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer/shorter steps: under 8 minutes on one H200")
    parser.add_argument("--out", default="runs/mfu/mfu.json")
    parser.add_argument("--work", default=None, help="shards and run dirs (default: a folder beside --out)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip what would not finish by then")
    parser.add_argument("--baseline-mbs", default=None, help="comma list (default quick 16,8; full 16,8,12)")
    parser.add_argument("--late-baseline-mbs", default=None, help="baseline micro-batches run at the end, as the budget allows (quick: 12)")
    parser.add_argument("--default-mbs", default=None, help="comma list (default: the recipe's, and 16)")
    parser.add_argument("--small-batch", type=int, default=None, help="global batch of the ablation rows before LAMB")
    parser.add_argument("--large-batch", type=int, default=None, help="global batch of baseline, LAMB and default rows")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    parser.add_argument("--window", type=int, default=1024, help="the ablation's sliding window")
    parser.add_argument("--source-bytes", type=int, default=None, help="corpus bytes to shard")
    parser.add_argument("--only", default="ceilings,baseline,default,ab,profile,ablation,extras",
                        help="which parts to run, comma list (also: zero1, the extras' ZeRO-1 row alone; "
                             "bound, the model's GEMMs + attention alone, see bound.py; fp8, fp8_rows.py's rows; "
                             "kernels, an MoE recipe's compiled trainer step by kernel; titan, a Llama recipe's second peer: "
                             "torchtitan's llama3 at the baseline's micro-batches, torchtitan_baseline.py)")
    parser.add_argument("--fp8-variants", default="", help="fp8_rows.py: comma list of extra megatrain FP8 rows "
                        "(e.g. rowwise, keep-ends, mb8)")
    parser.add_argument("--variants", default="", help=f"comma list of A/B rows of the default: {', '.join(VARIANTS)}")
    parser.add_argument("--fp8-no-bound", action="store_true", help="fp8: skip bound.py's FP8 GEMM bound (measured once)")
    parser.add_argument("--baseline-eager", action="store_true", help="the baseline without torch.compile (CPU smoke tests)")
    parser.add_argument("--trace", action="store_true", help="also write the profile's chrome trace (gzip)")
    parser.add_argument("--forward-probe", action="store_true",
                        help="profile: one forward of the trainer's module beside a fresh model's (mfu_profile.forward_probe)")
    parser.add_argument("--init-from", default=None,
                        help="MoE: a transformers folder (megatrain export of a warmed-up run) that both the baseline "
                             "and megatrain's rows start from; default: each its own random init")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE for every megatrain row and the baseline shape")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:  # before any row runs: a typo would otherwise surface after the baseline's minutes
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    args.budget_s = args.budget_s or (470.0 if args.quick else 3600.0)
    args.small_batch = args.small_batch or (48 if args.quick else 128)
    args.large_batch = args.large_batch or (192 if args.quick else 512)
    args.steps = args.steps or (2 if args.quick else 3)
    args.source_bytes = args.source_bytes or (6_000_000 if args.quick else 16_000_000)
    args.work = args.work or str(Path(args.out).resolve().parent / "mfu-work")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    only = set(args.only.split(","))

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("DeepSpeed", "deepspeed", "megatrain"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch._dynamo.config.automatic_dynamic_shapes = False  # a run never changes shapes; this benchmark does
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    else:
        torch._dynamo.config.cache_size_limit = 64
    torch.set_float32_matmul_precision("high")

    from megatrain.config import load_config
    from megatrain.parallel.init import init_distributed

    env = init_distributed(device=args.device)
    device = env.device
    bench = Bench(args)
    bench.report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(f"device: {bench.report['device']}; torch {torch.__version__}; budget {args.budget_s:.0f}s")

    recipe = load_config(args.config, args.override)
    bench.recipe_batch, bench.seq_len = recipe.train.global_batch_size, recipe.seq_len
    data_overrides = [f"data.shard_url={args.work}/shards", f"data.max_source_bytes={args.source_bytes}",
                      "data.num_workers=0", *args.override]
    if args.init_from:  # the shards in the ids of the model's own tokenizer, as the trainer requires
        data_overrides.append(f"data.tokenizer={Path(args.init_from).resolve()}")
    common = [
        *data_overrides, f"train.device={device.type}", "train.steps=100000", "train.log_interval=1000000",
        "checkpoint.interval=1000000000", "checkpoint.resume=false", "reliability.heartbeat_interval_s=30",
        *([f"checkpoint.init_from=hf:{Path(args.init_from).resolve()}"] if args.init_from else []),
    ]
    data = Data(args, data_overrides)
    data.start()
    shape_cfg = load_config(args.config, [*common])
    moe = recipe.model.mlp == "moe"  # mfu_moe.py: its own rows, the dense ablation does not apply
    if "ceilings" in only and not moe:
        measure_ceilings(bench, shape_cfg, device)

    def run_dirs(key: str) -> list[str]:
        d = f"{args.work}/runs/{key}"
        return [f"train.run_dir={d}", f"checkpoint.staging_dir={d}/staging", f"checkpoint.durable_url={d}/ckpt"]

    def est_seconds(global_batch: int, steps: int, compile_s: float) -> float:
        tokens = global_batch * recipe.seq_len * (steps + 1)
        return 15 + compile_s + tokens / (40_000 if device.type == "cuda" else 2_000)

    def fits(what: str, seconds: float) -> bool:
        if bench.remaining() < seconds:
            log(f"skipping {what}: ~{seconds:.0f}s needed, {bench.remaining():.0f}s left in the budget")
            bench.report.setdefault("skipped", []).append(what)
            bench.save()
            return False
        return True

    # 2. the baseline
    recipe_mb = recipe.train.micro_batch_size
    baseline_mbs = [int(x) for x in (args.baseline_mbs or ("16,8" if args.quick else "16,8,12")).split(",")]
    late_baseline_mbs = [int(x) for x in (("12" if args.quick else "") if args.late_baseline_mbs is None else args.late_baseline_mbs).split(",") if x]

    def baseline(mb: int, **variant) -> Result | None:
        """variant: run_baseline's convert/key/label/precision (fp8_rows.py's torchao row)."""
        if fits(f"{variant.get('key', 'baseline')} mb {mb}", est_seconds(args.large_batch, args.steps, 60)):
            log(f"{variant.get('label', 'baseline')}, micro-batch {mb}")
            profile_it = "profile" in only and device.type == "cuda" and mb == recipe_mb and not variant and not moe
            try:
                r = bench.add(run_baseline(bench, shape_cfg, data, env, mb, args.large_batch, args.steps, profile_it,
                                              compile_model=not args.baseline_eager, **variant))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot be built must not lose the other rows
                key = variant.get("key", "baseline")
                r = bench.add(Result(key=f"{key}-mb{mb}", label=f"{variant.get('label', key)}, mb {mb}", kind="baseline",
                                     micro_batch=mb, global_batch=args.large_batch, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            log(f"  -> {fmt(r.tokens_per_s, ',.0f')} tok/s, MFU {fmt(r.mfu and 100 * r.mfu, '.1f')}%, peak {fmt(r.peak_gib, '.1f')} GiB {r.error or ''}")
            return r
        return None

    if "baseline" in only and not moe:
        for mb in baseline_mbs:
            baseline(mb)
    if "titan" in only and recipe.model.position == "rope" and not moe:  # the Llama family's second peer
        from torchtitan_baseline import LABEL as TITAN_LABEL

        for mb in baseline_mbs:
            baseline(mb, peer="torchtitan", key="torchtitan", label=TITAN_LABEL)

    # 2b. the bound: the model's GEMMs and attention alone, beside the baseline just measured
    if "bound" in only and not moe and fits("bound", 120):
        from bound import measure_bound, table

        base = [r.tokens_per_s for r in bench.results if r.kind == "baseline" and r.tokens_per_s]
        windows = [args.window, args.window // 2, args.window // 4]
        bench.report["bound"] = measure_bound(shape_cfg.model, recipe_mb, args.large_batch, device, windows=windows,
                                              baseline_tokens_per_s=max(base, default=None), log=log)
        bench.report["bound"]["table"] = table(bench.report["bound"])
        log(bench.report["bound"]["table"])
        bench.save()

    def megatrain_row(spec: Spec, mb: int | None, steps: int, warmup: int = 1) -> Result | None:
        gb = args.small_batch if spec.batch == "small" else args.large_batch
        try:
            cfg = build_config(args, [*spec.overrides, *run_dirs(spec.key)], common, mb, gb)
        except Exception as exc:  # noqa: BLE001 - an impossible combination (e.g. window > seq_len)
            log(f"{spec.key}: bad configuration: {exc}")
            return bench.add(Result(key=spec.key, label=spec.label, kind="megatrain", micro_batch=mb or 0,
                                    global_batch=gb, error=f"config: {str(exc)[:300]}"))
        compile_s = 60 if cfg.model.compile else (30 if cfg.model.attention == "sliding" else 0)
        if spec.compile_options and spec.compile_options.get("max_autotune"):
            compile_s = 240
        if not fits(spec.key, est_seconds(gb, steps + warmup - 1, compile_s)):
            return None
        log(f"{spec.key}: {spec.label} (mb {cfg.train.micro_batch_size}, global batch {gb})")
        r = bench.add(run_megatrain(bench, spec, cfg, env, data, steps, warmup))
        log(f"  -> {fmt(r.tokens_per_s, ',.0f')} tok/s, MFU {fmt(r.mfu and 100 * r.mfu, '.1f')}%, peak {fmt(r.peak_gib, '.1f')} GiB {r.error or ''}")
        return r

    if moe:  # a mixture of experts (issue 32): megatrain beside transformers' MoE class, mfu_moe.py
        from mfu_moe import moe_table, run_moe, summarize_moe

        def moe_profile_cfg(mb: int):
            return (build_config(args, ["model.compile=false", *run_dirs("moe-profile")], common, mb, 2 * mb)
                    if fits("moe profile", 90) else None)

        run_moe(bench, args, recipe, only, baseline, megatrain_row, moe_profile_cfg, env, data)
        if "kernels" in only and fits("trainer profile", 90):  # the compiled step by kernel, GPU idle included
            mb = int((args.default_mbs or str(recipe_mb)).split(",")[0])
            run_profile(bench, build_config(args, run_dirs("profile"), common, mb, 4 * mb), env, data, micro_batches=4)
        bench.report["table"] = print_table(bench) + "\n" + moe_table(bench)
        bench.report["summary"] = summarize_moe(bench, on_cuda=device.type == "cuda")
        return finish(bench, data)

    # 3. megatrain's default (the recipe as it is), at each micro-batch
    default_mbs = [int(x) for x in (args.default_mbs or f"{recipe_mb},8,16").split(",")]
    default_mbs = list(dict.fromkeys(default_mbs))
    defaults: list[Result] = []
    if "default" in only:
        for mb in default_mbs:
            label = f"megatrain default ({Path(args.config).name}), mb {mb}"
            r = megatrain_row(Spec(f"default-mb{mb}", label, [], "large"), mb, args.steps)
            if r is not None and r.tokens_per_s:
                defaults.append(r)

    # FP8 (issue 16, fp8_rows.py): the baseline with torchao float8, megatrain FP8, its profile
    if "fp8" in only:
        import fp8_rows

        fp8_rows.run(bench, baseline=baseline, recipe_mb=recipe_mb, variants=[v for v in args.fp8_variants.split(",") if v],
                     with_baseline="baseline" in only,
                     with_bound=not args.fp8_no_bound,
                     megatrain_row=lambda key, label, overrides, mb: megatrain_row(Spec(key, label, overrides, "large"), mb, args.steps),
                     profile=lambda overrides: run_profile(
                         bench, build_config(args, [*overrides, *run_dirs("profile-fp8")], common, recipe_mb, 2 * recipe_mb),
                         env, data, micro_batches=2, report_key="profile_fp8") if fits("fp8 profile", 90) else None,
                     bound=lambda: fits("fp8 bound", 60) and fp8_rows.gemm_bound(bench, shape_cfg.model, recipe_mb, device, log))

    # A/B of the parallel block's fused projections (module switch, not a config field)
    if "default" in only and "ab" in only:
        ab = Spec(f"default-mb{recipe_mb}-fusedproj", f"default, mb {recipe_mb}, + fused projections (PaLM)",
                  [], "large", fuse="compile")
        megatrain_row(ab, recipe_mb, args.steps)
    variants: list[tuple[Result, list[str], dict | None]] = []
    for name in args.variants:
        spec = variant_spec(name, recipe_mb, "default")
        r = megatrain_row(spec, recipe_mb, args.steps)
        if r is not None and r.tokens_per_s and name not in MODEL_CHANGES:
            variants.append((r, spec.overrides, spec.compile_options))

    # 4. profile of the best default (with the fastest inductor variant, if one beat it)
    if "profile" in only:
        best = max(defaults, key=lambda r: r.tokens_per_s) if defaults else None
        best_mb = best.micro_batch if best else recipe_mb
        overrides, options = [], None
        fastest = max(variants, key=lambda v: v[0].tokens_per_s, default=None)
        if fastest and (best is None or fastest[0].tokens_per_s > best.tokens_per_s):
            best_mb, overrides, options = recipe_mb, fastest[1], fastest[2]
        if fits("profile", 60 + (120 if options and options.get("max_autotune") else 0)):
            log(f"profile: default, mb {best_mb}, 2 micro-batches, {overrides} inductor options {options}")
            cfg = build_config(args, [*overrides, *run_dirs("profile")], common, best_mb, 2 * best_mb)
            run_profile(bench, cfg, env, data, micro_batches=2, compile_options=options)

    # 5. the ablation (MegaScale Table 3 order), at the recipe's micro-batch
    if "ablation" in only:
        z = ["parallel.zero_stage=1"]  # one GPU: partitions nothing, costs what ZeRO-0 does, and checkpoints in bf16
        ref_kernels = ["model.kernels.layernorm=reference", "model.kernels.gelu=reference",
                       "model.kernels.cross_entropy=reference", "model.kernels.attention=sdpa"]
        auto_kernels = ["model.kernels.layernorm=auto", "model.kernels.gelu=auto",
                        "model.kernels.cross_entropy=auto", "model.kernels.attention=auto"]
        full = ["model.attention=full", "model.window=null"]
        window = ["model.attention=sliding", f"model.window={args.window}"]
        adamw = ["optim.name=adamw", "optim.lr=6e-4", "optim.min_lr=6e-5"]
        eager = ["model.compile=false"]
        serial = Spec("abl-1-serial", "ablation 1: serial block, reference kernels, AdamW", [*z, "model.block=serial", *full, *ref_kernels, *eager, *adamw], "small")
        megatrain_row(serial, recipe_mb, args.steps + 1)
        par = Spec("abl-2-parallel", "ablation 2: + parallel block", [*z, "model.block=parallel", *full, *ref_kernels, *eager, *adamw], "small")
        r2 = megatrain_row(par, recipe_mb, args.steps + 1)
        win = Spec("abl-3-window", f"ablation 3: + sliding window {args.window} (flex)", [*z, "model.block=parallel", *window, *ref_kernels, *eager, *adamw], "small")
        r3 = megatrain_row(win, recipe_mb, args.steps + 1)
        keep = bool(r2 and r3 and r2.tokens_per_s and r3.tokens_per_s and r3.tokens_per_s > 1.01 * r2.tokens_per_s)
        att = window if keep else full
        note = f"window {args.window} {'kept' if keep else 'dropped (not faster)'}"
        bench.report["window_kept"] = keep
        fused = Spec("abl-4-fused", "ablation 4: + fused kernels (Triton LN/GeLU/CE)", [*z, "model.block=parallel", *att, *auto_kernels, *eager, *adamw], "small", note=note)
        megatrain_row(fused, recipe_mb, args.steps + 1)
        comp = Spec("abl-5-compile", "ablation 5: + torch.compile (blocks), 4 projections", [*z, "model.block=parallel", *att, *auto_kernels, "model.compile=true", *adamw], "small", fuse="never", note=note)
        megatrain_row(comp, recipe_mb, args.steps + 1)
        proj = Spec("abl-6-fusedproj", "ablation 6: + fused projections (PaLM)", [*z, "model.block=parallel", *att, *auto_kernels, "model.compile=true", *adamw], "small", fuse="compile", note=note)
        r6 = megatrain_row(proj, recipe_mb, args.steps + 1)
        r5 = next((r for r in bench.results if r.key == "abl-5-compile"), None)
        keep_fused = bool(r5 and r6 and r5.tokens_per_s and r6.tokens_per_s and r6.tokens_per_s > r5.tokens_per_s)
        note += f"; fused projections {'kept' if keep_fused else 'dropped (not faster)'}"
        lamb = Spec("abl-7-lamb", "ablation 7: + LAMB, 4x global batch", [*z, "model.block=parallel", *att, *auto_kernels, "model.compile=true", "optim.name=lamb"], "large",
                    fuse="compile" if keep_fused else "never", note=note)
        megatrain_row(lamb, recipe_mb, args.steps)

    # 6. extras: what the recipe's other choices cost under compile
    if "extras" in only or "zero1" in only:
        megatrain_row(Spec("extra-zero1", "default + ZeRO-1 (LAMB on flat partitions)", ["parallel.zero_stage=1"], "large"),
                      recipe_mb, args.steps)
    if "extras" in only:
        for w in ([args.window] if args.quick else [args.window, args.window // 2]):
            if w < recipe.seq_len:
                megatrain_row(Spec(f"extra-window{w}", f"default + sliding window {w} (flex, compiled)",
                                   ["model.attention=sliding", f"model.window={w}"], "large"), recipe_mb, args.steps)

    # the baseline's remaining micro-batches, last: what the budget leaves
    if "baseline" in only:
        for mb in late_baseline_mbs:
            baseline(mb)

    # summary: the fastest default against the fastest baseline
    summary = summarize(bench, defaults, llama=recipe.model.position == "rope", on_cuda=device.type == "cuda")
    if summary is not None:
        bench.report["summary"] = summary
    bench.report["table"] = print_table(bench)
    if "fp8" in only:
        bench.report["fp8"] = fp8_rows.summary(bench)
    return finish(bench, data)


def finish(bench: Bench, data: Data) -> int:
    bench.report["wall_s"] = time.perf_counter() - T0
    bench.save()
    if data.proc is not None and data.proc.poll() is None:
        data.proc.terminate()
    log(f"done in {time.perf_counter() - T0:.0f}s; JSON: {bench.args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
