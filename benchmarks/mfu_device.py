"""The device side of ``benchmarks/mfu.py``: memory bookkeeping between configurations (every row
starts from an emptied cache and reset peak statistics) and the chip's ceilings: a bf16 8192^3
matmul, a device-to-device copy, and the model's own GEMM shapes alone.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from bound import copy_gbs, time_ms  # benchmarks/bound.py
from mfu_report import Bench, log

GIB = 2**30


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
    a = b = None  # free them (not del: the lambda above refers to them)
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
            inp = w = None  # free them (not del: the lambda above refers to them)
    bench.report["gemm_shapes"] = rows
    torch.cuda.empty_cache()
    c = bench.report["ceilings"]
    log(f"ceilings: bf16 matmul {c['matmul_8192_bf16_tflops']:.0f} TFLOP/s, copy {c['copy_gbs_read_plus_write']:.0f} GB/s")
    for r in rows:
        log(f"  gemm {r['gemm']:<22} M={r['M']:>6} N={r['N']:>6} K={r['K']:>6}: {r['tflops']:.0f} TFLOP/s")
    bench.save()
