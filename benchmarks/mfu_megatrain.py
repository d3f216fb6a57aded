"""One megatrain row of ``benchmarks/mfu.py``: a ``Spec`` (config overrides, and the module
switches that are not config fields) built into a real ``megatrain.training.trainer.Trainer`` on the device
and timed over ``trainer.train_step()`` calls; the A/B variants of the default (``--variants``).
A configuration measured before (same config, same switches) is not measured again.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from mfu_data import Data
from mfu_device import allocated_gib, peak_gib, reset_memory
from mfu_report import Bench, Result, load_balance, log, median_phases

# A/B rows of the default (``--variants``): config overrides and inductor settings for the
# compiled blocks. max_autotune benchmarks Triton GEMM templates (epilogues such as bias + GeLU
# fused in) against cuBLAS for every GEMM shape of the block, forward and backward, and keeps the
# faster. "fused" kernels run megatrain's Triton kernels inside the compiled blocks instead of
# letting inductor generate its own from the reference ops.
VARIANTS: dict[str, tuple[list[str], dict | None]] = {
    "cdtune": ([], {"coordinate_descent_tuning": True}),
    "autotune": ([], {"max_autotune": True, "triton.enable_persistent_tma_matmul": True}),
    "autotune-notma": ([], {"max_autotune": True}),
    "gelu-fused": (["model.kernels.gelu=fused"], None),
    "ln-fused": (["model.kernels.layernorm=fused"], None),
    "ln-gelu-fused": (["model.kernels.gelu=fused", "model.kernels.layernorm=fused"], None),
    "gelu-reference": (["model.kernels.gelu=reference"], None),
    "ln-reference": (["model.kernels.layernorm=reference"], None),
    "nobias": (["model.bias=false"], None),
    "parallel-block": (["model.block=parallel"], None),  # Llama recipes: MegaScale's block with the same parts
    "llama-fused": (["model.kernels.rmsnorm=fused", "model.kernels.swiglu=fused", "model.kernels.rope=fused"], None),
    "swiglu-fused": (["model.kernels.swiglu=fused"], None),
    # Triton RoPE in training; since attention.QKV_ROPE_ONE_PASS also the default on a GPU (auto)
    "rope-fused": (["model.kernels.rope=fused"], None),
    "rmsnorm-fused": (["model.kernels.rmsnorm=fused"], None),
    "swiglu-reference": (["model.kernels.swiglu=reference"], None),  # inductor's SwiGLU
    # ZeRO's overlap_comm off (on one GPU nothing to overlap; moe-gpu-2b on an H200: the same speed)
    "no-overlap-comm": (["parallel.overlap.dp_overlap_comm=false"], None),
    "router-reference": (["model.kernels.moe_router=reference"], None),  # torch.topk and scatter_add_
    # attention only within each packed document (flex attention's block mask; issue 47's cost row)
    "document-mask": (["model.attention_mask=document"], None),
}
# Variants that set a module attribute for their row (restored after it): (module, attribute) -> value.
MODULE_SETTINGS: dict[str, dict[tuple[str, str], Any]] = {
    # the LM-head loss in chunks of <= 2^28 logits even where the micro-batch fits one chunk
    "ce-chunked": {("megatrain.kernels.cross_entropy", "ONE_CHUNK_LOGITS"): 0},
    # DeepSpeed's throughput timer as DeepSpeed defaults it (a device sync twice per micro-batch)
    "ds-timer-sync": {("megatrain.parallel.deepspeed", "THROUGHPUT_TIMER"): {"enabled": True, "synchronized": True}},
    # rotated q and k stored as Inductor lays them out, [B, H, T, hd] (model/attention.py)
    "rope-head-major": {("megatrain.model.attention", "ROPE_TOKEN_MAJOR"): False},
    # DeepSpeed's ZeRO gradient norm and overflow check, one tensor at a time (parallel/zero_norms.py)
    "ds-norms": {("megatrain.parallel.zero_norms", "ENABLED"): False},
    # DeepSpeed's fp32 gradient partition (flatten, convert, clip: three passes; parallel/zero_step.py)
    "ds-step": {("megatrain.parallel.zero_step", "ENABLED"): False},
    # DeepSpeed's boundary reduction on one data-parallel rank (two copies of every gradient)
    "ds-reduce": {("megatrain.parallel.zero_step", "ONE_RANK_IN_PLACE"): False},
    # the router's weights in the MoE combine, not inside the experts (model/moe.py)
    "weighted-combine": {("megatrain.model.moe", "WEIGHTS_IN_EXPERTS"): False},
    # the serial block's skip connection added by the block, not by the MoE combine (model/block.py)
    "residual-add": {("megatrain.model.block", "MOE_TAKES_RESIDUAL"): False},
    # a serial MoE block's first RMSNorm left to inductor, not the Triton kernel carrying the skip (model/block.py)
    "norm1-inductor": {("megatrain.model.block", "NORM1_CARRIES_SKIP"): False},
    # micro-batches copied to the GPU from pageable memory, not pinned (training/trainer.py)
    "pageable-batches": {("megatrain.training.trainer", "PIN_BATCHES"): False},
    # the Triton RMSNorm backward as it was: 4 programs per SM, one row at a time (default 8 holding
    # 4 rows each; benchmarks/rmsnorm_skip_bench.py)
    "rms-bwd-rows1": {("megatrain.kernels.rmsnorm_triton", "BWD_PROGRAMS_PER_SM"): 4,
                      ("megatrain.kernels.rmsnorm_triton", "BWD_ROWS_AT_ONCE"): 1},
    # qkv's split, RoPE and the tokens-first layout left to inductor (default: one Triton pass each
    # way, model/attention.py QKV_ROPE_ONE_PASS)
    "rope-inductor": {("megatrain.model.attention", "QKV_ROPE_ONE_PASS"): False},
}
VARIANTS.update({name: ([], None) for name in MODULE_SETTINGS})  # their rows change no override
# Variants that change the model itself (not how it runs): measured for information, never
# profiled as "the fastest default".
MODEL_CHANGES = {"nobias", "parallel-block", "document-mask"}


@dataclass
class Spec:
    key: str
    label: str
    overrides: list[str]
    batch: str  # "small" | "large"
    fuse: str | None = None  # megatrain.model.block.FUSE_PROJECTIONS; None: the module's default
    note: str = ""
    compile_options: dict | None = None  # megatrain.parallel.parallelize.COMPILE_OPTIONS
    module_settings: dict | None = None  # MODULE_SETTINGS of a variant


def variant_spec(name: str, mb: int, label_prefix: str) -> Spec:
    """The A/B row of variant ``name`` (VARIANTS, MODULE_SETTINGS) at micro-batch ``mb``."""
    overrides, options = VARIANTS[name]
    label = f"{label_prefix}, mb {mb}, {name}: {' '.join(overrides)}{' inductor ' + str(options) if options else ''}"
    return Spec(f"default-mb{mb}-{name}", label, overrides, "large", compile_options=options,
                module_settings=MODULE_SETTINGS.get(name))


def close_trainer(trainer) -> None:
    for fn in (lambda: trainer.checkpointer.close(), lambda: trainer.heartbeat.close(phase=None),
               lambda: trainer.metrics.close(), lambda: trainer.loader.close(), lambda: trainer.engine.destroy()):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            log(f"  (cleanup: {type(exc).__name__}: {exc})")


def build_config(args, spec_overrides: list[str], common: list[str], mb: int | None, global_batch: int | None):
    from megatrain.config import load_config

    extra = []
    if mb is not None:
        extra.append(f"train.micro_batch_size={mb}")
    if global_batch is not None:
        extra.append(f"train.global_batch_size={global_batch}")
    return load_config(args.config, [*common, *args.override, *spec_overrides, *extra])


def make_trainer(cfg, env):
    from megatrain.training.trainer import Trainer

    # Build the model straight on the device: 1.3B parameters initialised on the host take
    # longer than the whole measurement (the trainer moves the model there anyway).
    with torch.device(env.device):
        return Trainer(cfg, env)


def run_megatrain(bench: Bench, spec: Spec, cfg, env, data: Data, steps: int, warmup: int) -> Result:
    import megatrain.model.block as block_module

    default_fuse = block_module.FUSE_PROJECTIONS
    fuse = spec.fuse or default_fuse
    device = env.device
    mb, gb = cfg.train.micro_batch_size, cfg.train.global_batch_size
    m = cfg.model
    kernels = m.kernels
    res = Result(key=spec.key, label=spec.label, kind="megatrain", micro_batch=mb, global_batch=gb, note=spec.note,
                 settings={"block": m.block, "attention": f"sliding {m.window}" if m.attention == "sliding" else "full",
                           "kernels": f"ln {kernels.layernorm}, gelu {kernels.gelu}, ce {kernels.cross_entropy}, attn {kernels.attention}",
                           "compile": "blocks" if m.compile else "no",
                           "fused_projections": fuse if m.block == "parallel" and m.compile else "n/a",
                           "optim": cfg.optim.name, "zero_stage": cfg.parallel.zero_stage})
    if m.mlp == "moe":  # moe_experts.resolve_experts_impl: auto = grouped GEMMs on Hopper in bf16
        res.settings["experts"] = f"{m.moe.n_experts} experts top-{m.moe.top_k}, impl {kernels.experts}"
    key = (json.dumps(cfg.model_dump(mode="json", exclude={"train": {"run_dir"}, "checkpoint": True}), sort_keys=True), fuse,
           json.dumps(spec.compile_options, sort_keys=True), repr(sorted((spec.module_settings or {}).items())))
    if spec.module_settings:
        res.settings["module_settings"] = {f"{m}.{a}": v for (m, a), v in spec.module_settings.items()}
    if spec.compile_options:
        res.settings["compile_options"] = spec.compile_options
    if key in bench.cache:
        prev = bench.cache[key]
        res.__dict__.update({k: v for k, v in prev.__dict__.items() if k not in ("key", "label", "note")})
        res.note = (spec.note + "; " if spec.note else "") + f"same configuration as {prev.key}: its measurement"
        return res
    data.ready(cfg)
    import megatrain.parallel.parallelize as parallelize_module

    block_module.FUSE_PROJECTIONS = fuse
    parallelize_module.COMPILE_OPTIONS = spec.compile_options
    saved_settings = {}
    for (module_name, attr), value in (spec.module_settings or {}).items():
        module = importlib.import_module(module_name)
        saved_settings[(module, attr)] = getattr(module, attr)
        setattr(module, attr, value)
    reset_memory(device)
    trainer = None
    try:
        t = time.perf_counter()
        trainer = make_trainer(cfg, env)
        res.init_s = time.perf_counter() - t
        times, phases, metrics = [], [], []
        for i in range(warmup + steps):
            metric = trainer.train_step()
            if i == 0:
                res.first_step_s = metric.step_time_s
                log(f"  {spec.key}: first step {metric.step_time_s:.1f}s")
            if i >= warmup:
                times.append(metric.step_time_s)
                metrics.append(metric)
            if metric.phases_ms and trainer.timers.reported_index is not None and trainer.timers.reported_index >= warmup:
                phases.append(metric.phases_ms)
        rest = trainer.timers.flush()
        phases += rest[-(steps - len(phases)):] if len(phases) < steps else []
        res.step_times_s = times
        res.step_s = statistics.median(times)
        res.tokens_per_s = trainer.tokens_per_step / res.step_s
        res.tokens_per_s_mean = trainer.tokens_per_step * len(times) / sum(times)
        res.flops_per_token = trainer.flops_per_token
        res.mfu = (res.tokens_per_s * trainer.flops_per_token / trainer.peak_flops) if trainer.peak_flops else None
        res.phases_ms = median_phases(phases, trainer.grad_accumulation)
        res.loss = metrics[-1].loss
        if getattr(metrics[-1], "moe", None):
            res.moe = load_balance([metric.moe for metric in metrics])
        res.peak_gib = peak_gib(device)
        bench.cache[key] = res
    except torch.cuda.OutOfMemoryError as exc:
        res.error = f"OOM: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001
        res.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc()
    finally:
        if trainer is not None:
            close_trainer(trainer)
        del trainer
        block_module.FUSE_PROJECTIONS = default_fuse
        parallelize_module.COMPILE_OPTIONS = None
        for (module, attr), value in saved_settings.items():
            setattr(module, attr, value)
        reset_memory(device)
        res.leftover_gib = allocated_gib(device)
        if res.leftover_gib and res.leftover_gib > 1.0:  # something (compiled code?) holds the last model
            torch._dynamo.reset()
            reset_memory(device)
            log(f"  {res.leftover_gib:.1f} GiB still allocated after cleanup; after torch._dynamo.reset(): "
                f"{allocated_gib(device):.1f} GiB")
            res.leftover_gib = allocated_gib(device)
    return res
