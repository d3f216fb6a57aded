"""Reference vs fused kernels at the 1.3B model's shapes, forward + backward, on one GPU.

    python benchmarks/kernels.py --out kernels.json [--only layernorm,gelu,ce,attention,lamb,llama]

Shapes: 8 x 2048 = 16384 tokens, d 2048, ff 8192, vocab 50304, 16 heads of 128, bf16; the Llama
ops (``llama``: RMSNorm, SwiGLU, RoPE) at Llama-3.2-1B's (32 heads of 64, SwiGLU ff 8192).
Ceilings are measured here, not taken from datasheets: a device-to-device copy
(``torch.empty_like(x).copy_(x)`` on 2 GiB, counting bytes read + written) for the
memory-bound kernels, and an 8192^3 bf16 matmul for the matmul-bound ones.

Two times per row: ``ms`` is eager (``triton.testing.do_bench``, median; includes Python, autograd
and launch overhead whenever the CPU is slower than the GPU), ``graph_ms`` replays the same work
captured in a CUDA graph (``do_bench_cudagraph``): GPU time alone, which is what counts in a
training step where the GPU runs behind the CPU. "GB/s" is the fewest bytes the op must move
(inputs read once, outputs written once) over ``graph_ms``, comparable to the copy ceiling.
The memory-bound fused kernels also get a per-kernel profile (printed, and in the JSON).
Prints a table; writes every number as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

TOKENS, D, FF, VOCAB, HEADS, HEAD_DIM, BATCH, SEQ = 8 * 2048, 2048, 8192, 50304, 16, 128, 8, 2048
BF16 = torch.bfloat16
PROFILES: dict[str, list[tuple[str, float]]] = {}  # fused op -> [(kernel, us per call)]


def bench(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """Median eager milliseconds of fn (CUDA events, after warm-up, L2 flushed between calls)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def bench_graph(fn: Callable[[], object], rep_ms: int = 100) -> float | None:
    """Median milliseconds of fn replayed from a CUDA graph; None if it cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception as exc:  # noqa: BLE001 - report, keep the eager number
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})")
        torch.cuda.synchronize()
        return None


def profile(name: str, fn: Callable[[], object], calls: int = 5) -> None:
    """Per-kernel GPU time of fn, averaged over ``calls`` (after one warm-up call)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    try:
        fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name[:60]] += event.time_range.elapsed_us() / calls
        PROFILES[name] = sorted(totals.items(), key=lambda kv: -kv[1])[:8]
    except Exception as exc:  # noqa: BLE001 - a profile is a bonus, never a reason to lose the timings
        print(f"  (profile of {name} failed: {type(exc).__name__}: {str(exc)[:120]})")


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor | None = None):
    """A closure running fn forward and its backward to ``inputs`` (no .grad accumulation)."""

    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [x for x in inputs if x.requires_grad], grad_out)

    return run


def fwd_only(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]):
    def run():
        with torch.no_grad():
            fn(*inputs)

    return run


def ceilings() -> dict:
    x = torch.randn(2**30, device="cuda", dtype=BF16)  # 2 GiB
    copy_ms = bench(lambda: torch.empty_like(x).copy_(x))
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    mm_ms = bench(lambda: a @ b)
    return {"copy_GBps": 2 * 2**31 / copy_ms / 1e6, "matmul_bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def row(op: str, impl: str, ms: float, graph_ms: float | None = None, bytes_: float | None = None,
        flops: float | None = None, **extra) -> dict:
    out = {"op": op, "impl": impl, "ms": ms, "graph_ms": graph_ms, **extra}
    best = graph_ms if graph_ms is not None else ms
    if bytes_ is not None:
        out["GBps"] = bytes_ / best / 1e6
    if flops is not None:
        out["TFLOPs"] = flops / best / 1e9
    return out


def timed(op: str, impl: str, fn: Callable[[], object], bytes_: float | None = None,
          flops: float | None = None, **extra) -> dict:
    return row(op, impl, bench(fn), bench_graph(fn), bytes_, flops, **extra)


def bench_layernorm() -> list[dict]:
    from megatrain.kernels import layernorm_triton
    from megatrain.kernels.layernorm import add_layer_norm, layer_norm

    x = torch.randn(TOKENS, D, device="cuda", dtype=BF16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.ones(D, device="cuda", dtype=BF16, requires_grad=True)
    b = torch.zeros(D, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    size = x.numel() * 2
    rows = []
    for impl in ("reference", "fused"):
        ln = lambda x, w, b, impl=impl: layer_norm(x, w, b, 1e-5, impl)  # noqa: E731
        rows.append(timed("layernorm fwd", impl, fwd_only(ln, [x, w, b]), 2 * size))  # read x, write y
        rows.append(timed("layernorm", impl, fwd_bwd(ln, [x, w, b], dy), 5 * size))  # + read x, dy, write dx
    profile("layernorm fused", fwd_bwd(lambda x, w, b: layer_norm(x, w, b, 1e-5, "fused"), [x, w, b], dy))
    for per_sm in (2, 8, 16):  # the backward's persistent grid: programs per SM (default 4)
        layernorm_triton.BWD_PROGRAMS_PER_SM = per_sm
        fn = fwd_bwd(lambda x, w, b: layer_norm(x, w, b, 1e-5, "fused"), [x, w, b], dy)
        rows.append(timed("layernorm", f"fused, bwd {per_sm}/SM", fn, 5 * size))
    layernorm_triton.BWD_PROGRAMS_PER_SM = 4

    for impl in ("reference", "fused"):
        def run(impl=impl):
            y, s = add_layer_norm(x, r, w, b, 1e-5, impl)
            torch.autograd.grad([y, s], [x, r, w, b], [dy, dy])

        # fwd: read x, r, write s, y; bwd: read s, dy, ds, write dx (one tensor serves x and r)
        rows.append(timed("add+layernorm", impl, run, 8 * size))
        if impl == "fused":
            profile("add+layernorm fused", run)
    return rows


def bench_gelu() -> list[dict]:
    from megatrain.kernels import gelu_triton
    from megatrain.kernels.gelu import bias_gelu

    x = torch.randn(TOKENS, FF, device="cuda", dtype=BF16, requires_grad=True)
    bias = torch.zeros(FF, device="cuda", dtype=torch.float32, requires_grad=True)  # fp32 param, as in training
    dy = torch.randn_like(x)
    size = x.numel() * 2
    rows = []
    for impl in ("reference", "fused"):
        gelu = lambda x, b, impl=impl: bias_gelu(x, b, impl)  # noqa: E731
        # the reference's x + fp32 bias promotes to fp32: its grad_out must be fp32 too
        grad = dy.float() if impl == "reference" else dy
        rows.append(timed("bias+gelu fwd", impl, fwd_only(gelu, [x, bias]), 2 * size))  # read x, write y
        rows.append(timed("bias+gelu", impl, fwd_bwd(gelu, [x, bias], grad), 5 * size))  # + read x, dy, write dx
    fused = lambda x, b: bias_gelu(x, b, "fused")  # noqa: E731
    profile("bias+gelu fused", fwd_bwd(fused, [x, bias], dy))
    gelu_triton.APPROX_TANH = False  # the exact tanh (one exp + one division per element)
    rows.append(timed("bias+gelu fwd", "fused, exact tanh", fwd_only(fused, [x, bias]), 2 * size))
    rows.append(timed("bias+gelu", "fused, exact tanh", fwd_bwd(fused, [x, bias], dy), 5 * size))
    gelu_triton.APPROX_TANH = True
    return rows


def bench_cross_entropy() -> list[dict]:
    from megatrain.kernels.cross_entropy import lm_head_cross_entropy
    from megatrain.kernels.cross_entropy import lm_head_cross_entropy_fused

    hidden = torch.randn(TOKENS, D, device="cuda", dtype=BF16, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, D, device="cuda")).requires_grad_()  # fp32 param under autocast
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    useful = 6 * TOKENS * VOCAB * D  # logits fwd (2NVd) + dhidden, dweight (4NVd)
    rows = []
    variants = [("reference", "reference", None), ("chunked", "chunked", None), ("fused", "fused", None),
                ("fused, 4096-row chunks", "fused", 4096)]
    for name, impl, chunk_rows in variants:
        def run(impl=impl, chunk_rows=chunk_rows):
            with torch.autocast("cuda", dtype=BF16):
                if chunk_rows is None:
                    loss = lm_head_cross_entropy(hidden, weight, targets, impl)
                else:
                    loss = lm_head_cross_entropy_fused(hidden, weight, targets, chunk_rows)
            torch.autograd.grad(loss, [hidden, weight])

        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
        rows.append(row("lm_head+CE", name, bench(run, rep_ms=400), flops=useful, peak_GB=peak_gb))
        if name == "fused":
            profile("lm_head+CE fused", run, calls=2)
    return rows


def _attention_flops(seq: int, window: int | None, batch: int) -> float:
    w = seq if window is None else window
    pairs = sum(min(i + 1, w) for i in range(seq))  # (query, key) pairs actually attended
    return 3.5 * 4 * batch * HEADS * HEAD_DIM * pairs  # fwd: QK^T + AV; bwd = 2.5x fwd


def bench_attention() -> list[dict]:
    from megatrain.kernels.attention import attention_sdpa
    from megatrain.kernels.flex_attention import attention_flex

    rows = []
    # At the training shape (T=2048), then at T=8192 with the same tokens, where windows pay more.
    for batch, seq, cases in (
        (BATCH, SEQ, [("sdpa (cuDNN/flash), full causal", "sdpa", None), ("flex, full causal", "flex", None),
                      ("flex, window 1024", "flex", 1024), ("flex, window 512", "flex", 512),
                      ("sdpa + dense mask, window 1024", "sdpa", 1024)]),
        (BATCH * SEQ // 8192, 8192, [("T=8192 sdpa, full causal", "sdpa", None),
                                     ("T=8192 flex, window 1024", "flex", 1024)]),
    ):
        shape = (batch, HEADS, seq, HEAD_DIM)
        q, k, v = [torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
        dout = torch.randn_like(q)
        for name, impl, window in cases:
            fn = attention_sdpa if impl == "sdpa" else attention_flex
            run = fwd_bwd(lambda q, k, v, fn=fn, window=window: fn(q, k, v, window), [q, k, v], dout)
            rows.append(timed("attention", name, run, flops=_attention_flops(seq, window, batch)))
        del q, k, v, dout
    return rows


def _lamb_shapes() -> list[tuple[int, ...]]:
    """The 1.3B GPT's parameter tensors (parallel block, biases, tied embedding)."""
    per_layer = [(3 * D, D), (3 * D,), (D, D), (D,), (FF, D), (FF,), (D, FF), (D,), (D,), (D,)]
    return [(VOCAB, D), (SEQ, D)] + per_layer * 24 + [(D,), (D,)]


def _lamb_foreach(params, grads, ms, vs, *, step, lr, beta1, beta2, eps, weight_decay, max_trust_ratio):
    """The torch._foreach formulation (as optim/lamb.py's CPU path), for comparison."""
    torch._foreach_mul_(ms, beta1)
    torch._foreach_add_(ms, grads, alpha=1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(ms, denom)
    torch._foreach_div_(updates, 1 - beta1**step)
    torch._foreach_add_(updates, params, alpha=weight_decay)
    w_norms, u_norms = torch._foreach_norm(params), torch._foreach_norm(updates)
    trust = [torch.where((w > 0) & (u > 0), (w / u).clamp(max=max_trust_ratio), torch.ones_like(w))
             for w, u in zip(w_norms, u_norms)]
    torch._foreach_mul_(updates, trust)
    torch._foreach_add_(params, updates, alpha=-lr)


def bench_lamb() -> list[dict]:
    from megatrain.kernels.lamb_triton import lamb_step_fused

    shapes = _lamb_shapes()
    params = [torch.randn(s, device="cuda") for s in shapes]
    grads = [torch.randn(s, device="cuda") for s in shapes]
    ms_ = [torch.zeros(s, device="cuda") for s in shapes]
    vs = [torch.zeros(s, device="cuda") for s in shapes]
    n = sum(p.numel() for p in params)
    hyper = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_trust_ratio=10.0)
    nbytes = 40 * n  # read g, m, v, w; write m, v; read m, v, w; write w (fp32)
    rows = []
    for name, fn in (("foreach", _lamb_foreach), ("fused (Triton)", lamb_step_fused)):
        ms = bench(lambda fn=fn: fn(params, grads, ms_, vs, **hyper), rep_ms=500)
        rows.append(row("lamb step", name, ms, bytes_=nbytes, params=n))
    return rows


# Llama-3.2-1B's shapes (configs/llama-1b.yaml) for the Llama ops: 8 x 2048 tokens, d 2048,
# SwiGLU ff 8192, 32 query / 8 KV heads of 64.
LLAMA_FF, LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 8192, 32, 8, 64


def _impls(fn: Callable[..., object]) -> list[tuple[str, Callable[..., object]]]:
    """The reference eager, the reference under torch.compile (what compiled blocks run), the Triton kernel."""
    return [("reference", lambda *a: fn(*a, impl="reference")),
            ("reference, torch.compile", torch.compile(lambda *a: fn(*a, impl="reference"))),
            ("fused", lambda *a: fn(*a, impl="fused"))]


def bench_llama() -> list[dict]:
    """RMSNorm (+ residual add), SwiGLU and RoPE, forward + backward, against the copy ceiling.
    Bytes: RMSNorm reads x and writes y, then reads x and dy and writes dx (5 passes of [T, d]);
    with the add, 8 (as add+layernorm); SwiGLU reads h [T, 2ff] and writes y [T, ff], then reads h
    and dy and writes dh (8 passes of [T, ff]); RoPE reads and writes q once each way (4 passes)."""
    from megatrain.kernels.rmsnorm import add_rms_norm, rms_norm
    from megatrain.kernels.rope import rope, rope_inv_freq, rope_tables
    from megatrain.kernels.swiglu import swiglu

    rows = []
    x = torch.randn(TOKENS, D, device="cuda", dtype=BF16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.ones(D, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    size = x.numel() * 2
    for impl, fn in _impls(lambda x, w, impl: rms_norm(x, w, 1e-5, impl)):
        rows.append(timed("rmsnorm", impl, fwd_bwd(fn, [x, w], dy), 5 * size))
    for impl, fn in _impls(lambda x, r, w, impl: add_rms_norm(x, r, w, 1e-5, impl)):
        def run(fn=fn):
            y, s = fn(x, r, w)
            torch.autograd.grad([y, s], [x, r, w], [dy, dy])

        rows.append(timed("add+rmsnorm", impl, run, 8 * size))
    profile("rmsnorm fused", fwd_bwd(lambda x, w: rms_norm(x, w, 1e-5, "fused"), [x, w], dy))
    del x, r, dy

    h = torch.randn(TOKENS, 2 * LLAMA_FF, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(TOKENS, LLAMA_FF, device="cuda", dtype=BF16)
    for impl, fn in _impls(lambda h, impl: swiglu(h, impl)):
        rows.append(timed("swiglu", impl, fwd_bwd(fn, [h], dy), 8 * dy.numel() * 2))
    profile("swiglu fused", fwd_bwd(lambda h: swiglu(h, "fused"), [h], dy))
    del h, dy

    # q as the model sees it: a [B, T, H, hd] slice of the qkv output, transposed to [B, H, T, hd]
    q = torch.randn(BATCH, SEQ, LLAMA_HEADS, LLAMA_HEAD_DIM, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    cos, sin = rope_tables(rope_inv_freq(LLAMA_HEAD_DIM, 500000.0, device=torch.device("cuda")), SEQ)
    dy = torch.randn(BATCH, LLAMA_HEADS, SEQ, LLAMA_HEAD_DIM, device="cuda", dtype=BF16)
    for impl, fn in _impls(lambda q, impl: rope(q, cos, sin, impl)):
        rows.append(timed("rope (q)", impl, fwd_bwd(fn, [q], dy), 4 * dy.numel() * 2))
    profile("rope fused", fwd_bwd(lambda q: rope(q, cos, sin, "fused"), [q], dy))
    del q, dy

    # grouped-query attention: SDPA reading the 8 shared KV heads (enable_gqa; cuDNN's kernel takes
    # no GQA, so flash runs) against repeating them to 32 heads first (cuDNN's kernel, plus copies)
    import torch.nn.functional as F

    from megatrain.kernels.attention import repeat_kv

    shape, kv_shape = (BATCH, LLAMA_HEADS, SEQ, LLAMA_HEAD_DIM), (BATCH, LLAMA_KV_HEADS, SEQ, LLAMA_HEAD_DIM)
    q = torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    dy = torch.randn(shape, device="cuda", dtype=BF16)
    flops = _attention_flops(SEQ, None, BATCH) * LLAMA_HEADS * LLAMA_HEAD_DIM / (HEADS * HEAD_DIM)
    variants = {"sdpa enable_gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                "repeat_kv + sdpa": lambda q, k, v: F.scaled_dot_product_attention(
                    q, repeat_kv(k, LLAMA_HEADS), repeat_kv(v, LLAMA_HEADS), is_causal=True)}
    for name, fn in variants.items():
        rows.append(timed("gqa attention", name, fwd_bwd(fn, [q, k, v], dy), flops=flops))
        profile(f"gqa attention {name}", fwd_bwd(fn, [q, k, v], dy))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for all results")
    parser.add_argument("--only", default="layernorm,gelu,ce,attention,lamb,llama")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    ceil = ceilings()
    suites = {"layernorm": bench_layernorm, "gelu": bench_gelu, "ce": bench_cross_entropy,
              "attention": bench_attention, "lamb": bench_lamb, "llama": bench_llama}
    rows: list[dict] = []
    for name in args.only.split(","):
        try:
            rows += suites[name]()
        except Exception as exc:  # one broken suite must not cost the others' numbers
            rows.append({"op": name, "impl": "FAILED", "error": f"{type(exc).__name__}: {exc}"[:500]})
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "shapes": dict(tokens=TOKENS, d=D, ff=FF, vocab=VOCAB, heads=HEADS, head_dim=HEAD_DIM, dtype="bf16"),
              "ceilings": ceil, "rows": rows, "kernel_profiles_us": PROFILES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)


def print_table(result: dict) -> None:
    ceil = result["ceilings"]
    print(f"\n{result['device']}, torch {result['torch']}: copy {ceil['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    for name, kernels in PROFILES.items():
        print(f"{name}: " + "; ".join(f"{k} {us:.0f} us" for k, us in kernels))
    print(f"{'op':<16} {'impl':<34} {'ms':>8} {'graph ms':>9} {'GB/s':>6} {'%copy':>6} {'TFLOP/s':>8} {'peak mem':>9}")
    for r in result["rows"]:
        if r["impl"] == "FAILED":
            print(f"{r['op']:<16} FAILED: {r['error']}")
            continue
        graph = f"{r['graph_ms']:.3f}" if r.get("graph_ms") is not None else ""
        gbps = f"{r['GBps']:.0f}" if "GBps" in r else ""
        pct = f"{100 * r['GBps'] / ceil['copy_GBps']:.0f}" if "GBps" in r else ""
        tf = f"{r['TFLOPs']:.0f}" if "TFLOPs" in r else ""
        mem = f"{r['peak_GB']:.2f} GB" if "peak_GB" in r else ""
        print(f"{r['op']:<16} {r['impl']:<34} {r['ms']:>8.3f} {graph:>9} {gbps:>6} {pct:>6} {tf:>8} {mem:>9}")


if __name__ == "__main__":
    main()
