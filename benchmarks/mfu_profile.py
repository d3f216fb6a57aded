"""The profile of ``benchmarks/mfu.py``: one optimizer step under ``torch.profiler``, its GPU time
summed by kernel and by kind (GEMM, attention, Triton, ...) and the GEMMs' achieved rate;
optionally the chrome trace (``--trace``, gzip).
"""

from __future__ import annotations

import gzip
import re
import shutil
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from mfu_data import Data
from mfu_device import reset_memory, sync
from mfu_megatrain import close_trainer, make_trainer
from mfu_report import Bench, log

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


def kernel_events(prof):
    """The CUDA events of a profile that are kernels (and copies), not the GPU-side ranges of
    annotations (``record_function``, torch.compile's ``## ... ##``, the profiler's steps).
    Kernel names may hold ``#`` (``{lambda(int)#1}``)."""
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        if not event.name.startswith(("##", "ProfilerStep", "Optimizer.")):
            yield event


def kernel_totals(prof) -> tuple[dict[str, float], dict[str, int]]:
    """GPU milliseconds and launches per kernel name in a profile."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in kernel_events(prof):
        totals[event.name] += event.time_range.elapsed_us() / 1e3
        counts[event.name] += 1
    return totals, counts


def busy_ms(prof) -> float:
    """Milliseconds in which at least one kernel ran (the union of the kernels' intervals, which
    overlap across streams): the profiled window minus this is GPU idle, waiting on the host."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernel_events(prof)):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def phased_kernels(prof) -> list[tuple[int, int, str, str]]:
    """(start ns, end ns, name, phase) of each kernel, by start: a kernel belongs to the
    ``megatrain.<phase>`` range (``Trainer.phase``) open when it was launched. The backward's kernels
    are launched by the autograd engine's thread while the main thread waits inside its backward
    range, so the launch time alone decides. Kernels and launches are matched by CUPTI correlation
    id, on the runtime calls only (a CPU op's own id is another counter that collides with it)."""
    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = list(prof.profiler.kineto_results.events())
    ranges = [(e.start_ns(), e.end_ns(), e.name().removeprefix("megatrain."))
              for e in events if e.device_type() == CPU and e.name().startswith("megatrain.")]
    launched_at = {e.correlation_id(): e.start_ns() for e in events
                   if e.device_type() == CPU and e.name().startswith("cu") and not e.is_user_annotation()}
    out = []
    for e in events:
        if e.device_type() != CUDA or e.is_user_annotation() or e.name().startswith(("##", "ProfilerStep", "Optimizer.")):
            continue
        t = launched_at.get(e.correlation_id())
        phase = next((name for lo, hi, name in ranges if t is not None and lo <= t <= hi), "other")
        out.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name(), phase))
    return sorted(out)


def kernels_by_phase(phased: list[tuple[int, int, str, str]]) -> dict[str, dict[str, float]]:
    """GPU milliseconds per kernel name in each phase of the trainer's step, from ``phased_kernels``."""
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for start, end, name, phase in phased:
        phases[phase][name] += (end - start) / 1e6
    return phases


def idle_by_phase(phased: list[tuple[int, int, str, str]]) -> dict[str, float]:
    """GPU idle milliseconds inside the profiled window (``phased_kernels``), each gap charged to
    the phase of the kernel that ends it: the phase whose launches the GPU was waiting for (a host
    sync drains the queue, and the GPU then waits while the host launches again)."""
    idle: dict[str, float] = defaultdict(float)
    busy_until = None
    for start, end, _, phase in phased:
        if busy_until is not None and start > busy_until:
            idle[phase] += (start - busy_until) / 1e6
        busy_until = end if busy_until is None else max(busy_until, end)
    return dict(sorted(idle.items(), key=lambda kv: -kv[1]))


def phase_summary(phased: list[tuple[int, int, str, str]], top: int = 40, per: int = 1) -> dict[str, Any]:
    """Per phase (``phased_kernels``): its kernels' total GPU time and its ``top`` kernels (full
    names), divided by ``per``."""
    return {phase: {"kernel_ms": sum(names.values()) / per,
                    "top": [{"name": n, "ms": ms / per} for n, ms in sorted(names.items(), key=lambda kv: -kv[1])[:top]]}
            for phase, names in kernels_by_phase(phased).items()}


def summarize_profile(prof, wall_ms: float, cfg, micro_batches: int, micro_batch: int) -> dict[str, Any]:
    """GPU time by kernel and by kind over one profiled optimizer step; the GEMM rate counts the
    6N matmul FLOPs of the step (the blocks' four projections and the LM head)."""
    totals, counts = kernel_totals(prof)
    phased = phased_kernels(prof)  # every kernel with its phase, read once for both splits below
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
        # kernels of several streams overlap: the idle time is the wall time their union leaves
        "wall_ms": wall_ms, "gpu_kernel_ms": gpu_ms, "gpu_idle_ms": wall_ms - busy_ms(prof),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "phases": phase_summary(phased),
        "idle_by_phase_ms": idle_by_phase(phased),
        "gemm_tflops": gemm_flops / gemm_ms / 1e9 if gemm_ms else None,
        "top_kernels": [{"name": n[:140], "ms": ms, "calls": counts[n], "kind": kind_of(n),
                         "share": ms / gpu_ms if gpu_ms else None}
                        for n, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:30]],
    }


def forward_probe(trainer, cfg) -> dict[str, Any]:
    """One no-grad forward of the next batch, under the profiler, through the trainer's module
    and through a fresh eager model of the same recipe: the same GEMM, attention and loss kernels,
    so a kernel that is slower in the trainer is slower for the trainer's state (its weights,
    their routing, the process), not for its code. Milliseconds per kernel name, top 15 each."""
    from torch.profiler import ProfilerActivity, profile

    from megatrain.model.gpt import GPT

    inputs, targets = next(trainer.batches)
    fresh = GPT(cfg.model).to(device=inputs.device, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    for name, module in (("trainer module", trainer.engine.module), ("fresh eager model", fresh)):
        with torch.no_grad():
            module(inputs, targets)  # warm-up: lazy inits, autotuned kernels
            sync(inputs.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                module(inputs, targets)
                sync(inputs.device)
        totals, _ = kernel_totals(prof)
        out[name] = dict(sorted(totals.items(), key=lambda kv: -kv[1])[:15])
    del fresh
    return out


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
        if bench.args.forward_probe and device.type == "cuda":  # a second model beside the trainer's: opt in
            prof_report["forward_probe"] = forward_probe(trainer, cfg)
        if metric.moe:  # routing skew lengthens the grouped GEMMs: the profiled step's, per layer
            prof_report["moe_max_over_mean"] = {k: v["max_over_mean"] for k, v in metric.moe["layers"].items()}
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
