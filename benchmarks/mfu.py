"""MFU benchmark (issue 7): megatrain's real training step against a standard PyTorch GPT of the
same shape, in one process, on one GPU, both fed by megatrain's real data pipeline. For a Llama
recipe (``--config configs/llama-1b.yaml``, issue 15) the baseline is Hugging Face's
``LlamaForCausalLM`` of the same shape (``llama_baseline.py``); use ``--only`` without
``ablation`` (its rows are the GPT's).

    python benchmarks/mfu.py --quick --out runs/mfu.json          # one device call (< 8 min)
    python benchmarks/mfu.py --out runs/mfu.json                  # longer steps, more micro-batches
    python benchmarks/mfu.py --quick --config configs/tiny-cpu.yaml --device cpu   # smoke test

What runs, in order of priority (a time budget skips what no longer fits; JSON is rewritten after
every measurement, so a run cut short still leaves its numbers):

1. ceilings: a bf16 8192^3 matmul and a device-to-device copy, and the model's GEMM shapes alone;
   with ``--only ...,bound`` also ``bound.py``'s speed of light of a micro-batch (after 2);
2. the baseline: a nanoGPT-style GPT written below (serial pre-LN blocks, SDPA causal attention,
   tanh GeLU MLP, tied LM head with full logits + F.cross_entropy, fp32 weights under bf16
   autocast, fused AdamW, global grad-norm clip, whole-model ``torch.compile``), at each
   micro-batch of ``--baseline-mbs``, fed by ``megatrain.data.loader`` from webdataset shards
   on local disk (``shard_corpus`` on the standard library's source, sharded in a background
   process while the baseline compiles);
3. megatrain's default: ``megatrain.trainer.Trainer`` built from the recipe (DeepSpeed engine,
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
import contextlib
import gc
import gzip
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere in the repo
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bound import copy_gbs, fmt, time_ms  # noqa: E402  (benchmarks/bound.py)

T0 = time.perf_counter()
GIB = 2**30


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- the baseline
class NanoBlock(nn.Module):
    """nanoGPT's Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d: int, n_head: int, ff: int, bias: bool, eps: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d, eps=eps, bias=bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.ln_2 = nn.LayerNorm(d, eps=eps, bias=bias)
        self.c_fc = nn.Linear(d, ff, bias=bias)
        self.mlp_proj = nn.Linear(ff, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d: int, ff: int, bias: bool, eps: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(NanoBlock(d, n_head, ff, bias, eps) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, eps=eps, bias=bias)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# ----------------------------------------------------------------------------- measurement
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


def extrapolate(res: Result, seq_len: int, global_batch: int) -> float | None:
    """tokens/s this configuration would reach at another global batch: the measured step minus
    its optimizer phase, scaled per micro-batch, plus the optimizer phase once per step."""
    if not res.step_s or "optimizer" not in res.phases_ms:
        return None
    opt_s = res.phases_ms["optimizer"] / 1e3
    per_micro_batch = (res.step_s - opt_s) / (res.global_batch // res.micro_batch)
    step = per_micro_batch * global_batch / res.micro_batch + opt_s
    return global_batch * seq_len / step


def _median_phases(per_step: list[dict[str, float]], accumulation: int) -> dict[str, float]:
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


# ----------------------------------------------------------------------------- device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def measure_ceilings(bench: Bench, cfg, device: torch.device) -> None:
    """The chip's bf16 matmul rate and copy bandwidth, and the model's own GEMM shapes."""
    if device.type != "cuda":
        return
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device)
    del a, b
    bench.report["ceilings"] = {"matmul_8192_bf16_tflops": 2 * n**3 / ms / 1e9, "copy_gbs_read_plus_write": copy_gbs(device)}
    m = cfg.model
    d, ff, V = m.d_model, m.ffn_dim, m.vocab_size
    rows = []
    for tokens in sorted({mb * cfg.seq_len for mb in (8, 16)}):
        shapes = {
            "qkv": (tokens, 3 * d, d), "fc": (tokens, ff, d), "attn_proj": (tokens, d, d), "mlp_proj": (tokens, d, ff),
            "fused_in [qkv|fc]": (tokens, 3 * d + ff, d), "fused_out [attn|mlp]": (tokens, d, d + ff),
            "lm_head chunk": (4096, V, d),
        }
        for name, (M, N, K) in shapes.items():
            inp = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
            t = time_ms(lambda: F.linear(inp, w), device, iters=10, warmup=3)
            rows.append({"gemm": name, "M": M, "N": N, "K": K, "ms": t, "tflops": 2 * M * N * K / t / 1e9})
            del inp, w
    bench.report["gemm_shapes"] = rows
    torch.cuda.empty_cache()
    c = bench.report["ceilings"]
    log(f"ceilings: bf16 matmul {c['matmul_8192_bf16_tflops']:.0f} TFLOP/s, copy {c['copy_gbs_read_plus_write']:.0f} GB/s")
    for r in rows:
        log(f"  gemm {r['gemm']:<22} M={r['M']:>6} N={r['N']:>6} K={r['K']:>6}: {r['tflops']:.0f} TFLOP/s")
    bench.save()


# ----------------------------------------------------------------------------- data
class Data:
    """Shards the corpus once (a background process), then hands out real loaders."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]):
        self.args, self.overrides = args, overrides
        self.proc: subprocess.Popen | None = None
        self.index = None
        self.started = time.perf_counter()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "megatrain.cli", "shard", "--config", self.args.config, *self.overrides]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.log_path = Path(self.args.work) / "shard.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT)
        log(f"sharding in the background: {' '.join(cmd[1:])}")

    def ready(self, cfg):
        if self.index is None:
            if self.proc is not None:
                rc = self.proc.wait()
                if rc != 0:
                    raise RuntimeError(f"sharding failed (rc {rc}):\n{self.log_path.read_text()[-3000:]}")
                log(f"shards ready after {time.perf_counter() - self.started:.1f}s")
            from megatrain.data.shard import shard_corpus

            self.index = shard_corpus(cfg.data, cfg.seq_len, cfg.model.vocab_size)  # finds the finished index
        return self.index

    def loader(self, cfg, micro_batch_size: int):
        from megatrain.data.loader import build_loader

        d = cfg.data
        return build_loader(self.ready(cfg), micro_batch_size=micro_batch_size, dp_rank=0, dp_size=1, seed=d.seed,
                            prefetch_batches=d.prefetch_batches, on_bad_shard=d.on_bad_shard,
                            verify_checksums=d.verify_checksums, shuffle_shards=d.shuffle_shards)


# ----------------------------------------------------------------------------- baseline run
def run_baseline(bench: Bench, cfg, data: Data, env, mb: int, global_batch: int, steps: int,
                 profile_it: bool = False, convert: Callable[[nn.Module], Any] | None = None,
                 key: str = "baseline", label: str = "", precision: str = "") -> Result:
    """``convert``: applied to the built model before the optimizer and compile (fp8_rows.py's
    torchao float8 row); ``key``/``label``/``precision`` name that row."""
    from megatrain.observe.mfu import flops_per_token, mfu, peak_flops
    from megatrain.observe.timers import StepTimers

    device = env.device
    m = cfg.model
    accumulation = global_batch // mb
    llama = m.position == "rope"  # the Llama family: HF LlamaForCausalLM (benchmarks/llama_baseline.py)
    name = "baseline HF LlamaForCausalLM (SDPA) + torch.compile" if llama else "baseline nanoGPT + torch.compile"
    res = Result(key=f"{key}-mb{mb}", label=f"{label or name}, mb {mb}", kind="baseline" if convert is None else "baseline-variant",
                 micro_batch=mb, global_batch=global_batch,
                 settings={"block": "serial", "attention": "full", "kernels": "torch", "compile": "whole model",
                           "optim": "AdamW (fused)", "precision": precision or "fp32 weights, bf16 autocast"})
    reset_memory(device)
    t = time.perf_counter()
    with torch.device(device):
        if llama:
            from llama_baseline import HFLlama

            model = HFLlama(m, cfg.seq_len)
        else:
            model = NanoGPT(m.vocab_size, cfg.seq_len, m.n_layer, m.n_head, m.d_model, m.ffn_dim, m.bias, m.norm_eps)
    n_params = sum(p.numel() for p in model.parameters())
    if convert is not None:
        convert(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=fused or None)
    compiled = torch.compile(model, dynamic=False)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    timers = StepTimers(device)
    res.init_s = time.perf_counter() - t

    def step(batches, timed: bool = True) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            with timers.phase("data"):
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with timers.phase("forward"), amp:
                loss = compiled(x, y) / accumulation
            with timers.phase("backward"):
                loss.backward()
            total += loss.detach()
        with timers.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total

    def random_batches():
        while True:
            tok = torch.randint(0, m.vocab_size, (mb, cfg.seq_len + 1))
            yield tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    loader = None
    try:
        # Compile on random tokens while the shards are being written (same shapes, same graphs).
        t = time.perf_counter()
        warm_accumulation, accumulation = accumulation, min(2, accumulation)
        step(random_batches()).item()
        accumulation = warm_accumulation
        timers = StepTimers(device)  # the timed loop's step indices start at 0 (its warm step)
        res.first_step_s = time.perf_counter() - t
        log(f"  {res.key}: compiled + first steps in {res.first_step_s:.1f}s")
        loader = data.loader(cfg, mb)

        def batches():
            while True:
                yield next(loader)

        it = batches()
        phases, times = [], []
        for i in range(1 + steps):  # one warm step on real data, then timed steps
            t = time.perf_counter()
            loss = step(it).item()
            dt = time.perf_counter() - t
            p = timers.end_step()
            if i >= 1:
                times.append(dt)
            if p and timers.reported_index is not None and timers.reported_index >= 1:
                phases.append(p)
        phases += [p for p in timers.flush()][-(steps - len(phases)):] if len(phases) < steps else []
        res.step_times_s = times
        res.step_s = statistics.median(times)
        res.tokens_per_s = global_batch * cfg.seq_len / res.step_s
        res.tokens_per_s_mean = global_batch * cfg.seq_len * len(times) / sum(times)
        res.flops_per_token = flops_per_token(m.model_copy(update={"seq_len": cfg.seq_len, "attention": "full"}), n_params)
        peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        res.mfu = mfu(res.tokens_per_s, res.flops_per_token, peak)
        res.phases_ms = _median_phases(phases, global_batch // mb)
        res.loss = loss
        res.peak_gib = peak_gib(device)
        if profile_it:  # one optimizer step of two micro-batches, as the default's profile
            from torch.profiler import ProfilerActivity, profile

            accumulation = 2
            sync(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                step(it).item()
                wall_ms = (time.perf_counter() - t) * 1e3
            report = summarize_profile(prof, wall_ms, cfg, 2, mb)
            bench.report["profile_baseline" if convert is None else f"profile_{key}"] = report
            if bench.args.trace:
                export_trace(prof, Path(bench.args.out).with_name("mfu_trace_baseline.json"))
            log(f"  baseline profile: wall {wall_ms:.0f} ms, GPU kernels {report['gpu_kernel_ms']:.0f} ms; " +
                ", ".join(f"{k} {v:.0f}" for k, v in report["by_kind_ms"].items()))
    except torch.cuda.OutOfMemoryError as exc:
        res.error = f"OOM: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
        res.error = f"{type(exc).__name__}: {str(exc)[:400]}"
        traceback.print_exc()
    finally:
        if loader is not None:
            loader.close()
        del model, compiled, opt, decay, no_decay
        torch._dynamo.reset()  # compiled code keeps the model alive otherwise
        reset_memory(device)
        res.leftover_gib = allocated_gib(device)
    return res


# ----------------------------------------------------------------------------- megatrain run
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
    "rope-fused": (["model.kernels.rope=fused"], None),  # Triton RoPE inside the compiled blocks too
    "rmsnorm-fused": (["model.kernels.rmsnorm=fused"], None),
    "swiglu-reference": (["model.kernels.swiglu=reference"], None),  # inductor's SwiGLU
    "ce-chunked": ([], None),  # MODULE_SETTINGS below
    "ds-timer-sync": ([], None),
}
# Variants that set a module attribute for their row (restored after it): (module, attribute) -> value.
MODULE_SETTINGS: dict[str, dict[tuple[str, str], Any]] = {
    # the LM-head loss in chunks of <= 2^28 logits even where the micro-batch fits one chunk
    "ce-chunked": {("megatrain.kernels.cross_entropy", "ONE_CHUNK_LOGITS"): 0},
    # DeepSpeed's throughput timer as DeepSpeed defaults it (a device sync twice per micro-batch)
    "ds-timer-sync": {("megatrain.parallel.deepspeed", "THROUGHPUT_TIMER"): {"enabled": True, "synchronized": True}},
}
# Variants that change the model itself (not how it runs): measured for information, never
# profiled as "the fastest default".
MODEL_CHANGES = {"nobias", "parallel-block"}


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


def close_trainer(trainer) -> None:
    for fn in (lambda: trainer.checkpointer.close(), lambda: trainer.heartbeat.close(phase=None),
               lambda: trainer.metrics.close(), lambda: trainer.loader.close(), lambda: trainer.engine.destroy()):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            log(f"  (cleanup: {type(exc).__name__}: {exc})")


def build_config(args, spec_overrides: list[str], common: list[str], mb: int | None, global_batch: int | None):
    from megatrain.config_load import load_config

    extra = []
    if mb is not None:
        extra.append(f"train.micro_batch_size={mb}")
    if global_batch is not None:
        extra.append(f"train.global_batch_size={global_batch}")
    return load_config(args.config, [*common, *args.override, *spec_overrides, *extra])


def make_trainer(cfg, env):
    from megatrain.trainer import Trainer

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
    import importlib

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
        res.phases_ms = _median_phases(phases, trainer.grad_accumulation)
        res.loss = metrics[-1].loss
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


# ----------------------------------------------------------------------------- profile
KINDS = (
    ("attention (cuDNN)", re.compile(r"cudnn|fmha|flash|sdpa", re.I)),
    ("gemm (cuBLAS)", re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.I)),
    ("gemm (inductor template)", re.compile(r"^triton_tem")),  # max-autotune's Triton GEMMs, epilogues fused
    ("nccl", re.compile(r"nccl", re.I)),
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("inductor (triton)", re.compile(r"^triton_")),
    ("megatrain triton", re.compile(r"^_[a-z_]+_kernel")),
    ("aten elementwise/reduce", re.compile(r"at::native|^void at::|^void \(anonymous|elementwise|reduce", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def summarize_profile(prof, wall_ms: float, cfg, micro_batches: int, micro_batch: int) -> dict[str, Any]:
    """GPU time by kernel and by kind over one profiled optimizer step; the GEMM rate counts the
    6N matmul FLOPs of the step (the blocks' four projections and the LM head)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        if "#" in event.name or event.name.startswith(("ProfilerStep", "Optimizer.")):
            continue  # GPU-side ranges of record_function annotations, not kernels
        totals[event.name] += event.time_range.elapsed_us() / 1e3
        counts[event.name] += 1
    gpu_ms = sum(totals.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, ms in totals.items():
        by_kind[kind_of(name)] += ms
    m = cfg.model
    tokens = micro_batches * micro_batch * cfg.seq_len
    # per layer: qkv [d, d + 2 kv] (kv = d without GQA), attention proj [d, d], 2 or 3 (SwiGLU) MLP matrices
    kv, mlp_mats = m.kv_heads * m.head_dim, (3 if m.mlp == "swiglu" else 2)
    gemm_flops = 6 * tokens * (m.n_layer * (m.d_model * (2 * m.d_model + 2 * kv) + mlp_mats * m.d_model * m.ffn_dim)
                               + m.vocab_size * m.d_model)
    gemm_ms = by_kind.get("gemm (cuBLAS)", 0.0) + by_kind.get("gemm (inductor template)", 0.0)
    return {
        "config": {"micro_batch": micro_batch, "micro_batches": micro_batches},
        "wall_ms": wall_ms, "gpu_kernel_ms": gpu_ms, "gpu_idle_ms": wall_ms - gpu_ms,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "gemm_tflops": gemm_flops / gemm_ms / 1e9 if gemm_ms else None,
        "top_kernels": [{"name": n[:140], "ms": ms, "calls": counts[n], "kind": kind_of(n),
                         "share": ms / gpu_ms if gpu_ms else None}
                        for n, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:30]],
    }


def export_trace(prof, path: Path) -> None:
    prof.export_chrome_trace(str(path))
    with path.open("rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()


def run_profile(bench: Bench, cfg, env, data: Data, micro_batches: int, compile_options: dict | None = None,
                report_key: str = "profile") -> None:
    """Two micro-batches (one optimizer step) of the default under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    import megatrain.parallel.parallelize as parallelize_module

    device = env.device
    data.ready(cfg)
    reset_memory(device)
    parallelize_module.COMPILE_OPTIONS = compile_options
    trainer = None
    try:
        trainer = make_trainer(cfg, env)
        for _ in range(2):
            trainer.train_step()
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            metric = trainer.train_step()
            sync(device)
            wall_ms = (time.perf_counter() - t) * 1e3
        prof_report = summarize_profile(prof, wall_ms, cfg, micro_batches, cfg.train.micro_batch_size)
        prof_report["step_ms_trainer"] = metric.step_time_s * 1e3
        prof_report["compile_options"] = compile_options
        bench.report[report_key] = prof_report
        if bench.args.trace and device.type == "cuda":
            export_trace(prof, Path(bench.args.out).with_name(f"mfu_trace_{report_key}.json"))
        log(f"profile: wall {wall_ms:.0f} ms, GPU kernels {prof_report['gpu_kernel_ms']:.0f} ms; " +
            ", ".join(f"{k} {v:.0f}" for k, v in prof_report["by_kind_ms"].items()))
    except Exception as exc:  # noqa: BLE001
        bench.report[report_key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        traceback.print_exc()
    finally:
        if trainer is not None:
            close_trainer(trainer)
        del trainer
        parallelize_module.COMPILE_OPTIONS = None
        reset_memory(device)
    bench.save()


# ----------------------------------------------------------------------------- table
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


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt-1.3b.yaml")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer/shorter steps: fits one device call")
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
                             "bound, the model's GEMMs + attention alone, see bound.py; fp8, fp8_rows.py's rows)")
    parser.add_argument("--fp8-variants", default="", help="fp8_rows.py: comma list of extra megatrain FP8 rows "
                        "(e.g. rowwise, keep-ends, mb8)")
    parser.add_argument("--variants", default="", help=f"comma list of A/B rows of the default: {', '.join(VARIANTS)}")
    parser.add_argument("--fp8-no-bound", action="store_true", help="fp8: skip bound.py's FP8 GEMM bound (measured once)")
    parser.add_argument("--trace", action="store_true", help="also write the profile's chrome trace (gzip)")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE for every megatrain row and the baseline shape")
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s or (470.0 if args.quick else 3600.0)
    args.small_batch = args.small_batch or (48 if args.quick else 128)
    args.large_batch = args.large_batch or (192 if args.quick else 512)
    args.steps = args.steps or (2 if args.quick else 3)
    args.source_bytes = args.source_bytes or (6_000_000 if args.quick else 16_000_000)
    args.work = args.work or str(Path(args.out).resolve().parent / "mfu-work")
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

    from megatrain.config_load import load_config
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
    common = [
        *data_overrides, f"train.device={device.type}", "train.steps=100000", "train.log_interval=1000000",
        "checkpoint.interval=1000000000", "checkpoint.resume=false", "reliability.heartbeat_interval_s=30",
    ]
    data = Data(args, data_overrides)
    data.start()
    shape_cfg = load_config(args.config, [*common])
    if "ceilings" in only:
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
    late_baseline_mbs = [int(x) for x in (args.late_baseline_mbs or ("12" if args.quick else "")).split(",") if x]

    def baseline(mb: int, **variant) -> Result | None:
        """variant: run_baseline's convert/key/label/precision (fp8_rows.py's torchao row)."""
        if fits(f"{variant.get('key', 'baseline')} mb {mb}", est_seconds(args.large_batch, args.steps, 60)):
            log(f"{variant.get('label', 'baseline')}, micro-batch {mb}")
            profile_it = "profile" in only and device.type == "cuda" and mb == recipe_mb and not variant
            r = bench.add(run_baseline(bench, shape_cfg, data, env, mb, args.large_batch, args.steps, profile_it, **variant))
            log(f"  -> {fmt(r.tokens_per_s, ',.0f')} tok/s, MFU {fmt(r.mfu and 100 * r.mfu, '.1f')}%, peak {fmt(r.peak_gib, '.1f')} GiB {r.error or ''}")
            return r
        return None

    if "baseline" in only:
        for mb in baseline_mbs:
            baseline(mb)

    # 2b. the bound: the model's GEMMs and attention alone, beside the baseline just measured
    if "bound" in only and fits("bound", 120):
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
    for name in [v for v in args.variants.split(",") if v]:
        overrides, options = VARIANTS[name]
        label = f"default, mb {recipe_mb}, {name}: {' '.join(overrides)}{' inductor ' + str(options) if options else ''}"
        r = megatrain_row(Spec(f"default-mb{recipe_mb}-{name}", label, overrides, "large", compile_options=options,
                               module_settings=MODULE_SETTINGS.get(name)), recipe_mb, args.steps)
        if r is not None and r.tokens_per_s and name not in MODEL_CHANGES:
            variants.append((r, overrides, options))

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
        z = ["parallel.zero_stage=0"]
        ref_kernels = ["model.kernels.layernorm=reference", "model.kernels.gelu=reference",
                       "model.kernels.cross_entropy=reference", "model.kernels.attention=sdpa"]
        auto_kernels = ["model.kernels.layernorm=auto", "model.kernels.gelu=auto",
                        "model.kernels.cross_entropy=auto", "model.kernels.attention=auto"]
        full = ["model.attention=full", "model.window=null"]
        window = ["model.attention=sliding", f"model.window={args.window}"]
        adamw = ["optim.name=adamw", "optim.lr=6e-4", "optim.min_lr=6e-5"]
        eager = ["model.compile=false"]
        serial = Spec("abl-1-serial", "ablation 1: serial block, reference kernels, AdamW", [*z, "model.block=serial", *full, *ref_kernels, *eager, *adamw], "small")
        r1 = megatrain_row(serial, recipe_mb, args.steps + 1)
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

    # summary
    base = [r for r in bench.results if r.kind == "baseline" and r.tokens_per_s]
    if base and defaults:
        b = max(base, key=lambda r: r.tokens_per_s)
        d = max(defaults, key=lambda r: r.tokens_per_s)
        bench.report["summary"] = {
            "baseline": b.key, "baseline_tokens_per_s": b.tokens_per_s, "baseline_mfu": b.mfu,
            "default": d.key, "default_tokens_per_s": d.tokens_per_s, "default_mfu": d.mfu,
            "speedup": d.tokens_per_s / b.tokens_per_s,
            "at_recipe_batch": {"global_batch": bench.recipe_batch, "baseline_tokens_per_s": b.tokens_per_s_at_recipe_batch,
                                "default_tokens_per_s": d.tokens_per_s_at_recipe_batch,
                                "default_mfu": (d.tokens_per_s_at_recipe_batch * d.flops_per_token / 989.4e12
                                                if d.tokens_per_s_at_recipe_batch and d.flops_per_token and device.type == "cuda" else None),
                                "speedup": (d.tokens_per_s_at_recipe_batch / b.tokens_per_s_at_recipe_batch
                                            if d.tokens_per_s_at_recipe_batch and b.tokens_per_s_at_recipe_batch else None)},
            # issue 7's targets for the GPT; issue 15's for the Llama family
            "targets": ({"speedup >= 1.15": d.tokens_per_s / b.tokens_per_s >= 1.15, "mfu >= 0.60": (d.mfu or 0) >= 0.60}
                        if recipe.model.position == "rope" else
                        {"speedup >= 1.12": d.tokens_per_s / b.tokens_per_s >= 1.12, "mfu >= 0.66": (d.mfu or 0) >= 0.66}),
        }
    bench.report["table"] = print_table(bench)
    if "fp8" in only:
        bench.report["fp8"] = fp8_rows.summary(bench)
    bench.report["wall_s"] = time.perf_counter() - T0
    bench.save()
    if data.proc is not None and data.proc.poll() is None:
        data.proc.terminate()
    log(f"done in {time.perf_counter() - T0:.0f}s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
