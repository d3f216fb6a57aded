"""Reference vs fused kernels at the 1.3B model's shapes, forward + backward, on one GPU.

    python benchmarks/kernels.py --out kernels.json [--only layernorm,gelu,ce,attention,lamb]

Shapes: 8 x 2048 = 16384 tokens, d 2048, ff 8192, vocab 50304, 16 heads of 128, bf16.
Ceilings are measured here, not taken from datasheets: a device-to-device copy
(``torch.empty_like(x).copy_(x)`` on 2 GiB, counting bytes read + written) for the
memory-bound kernels, and an 8192^3 bf16 matmul for the matmul-bound ones. For each memory-bound
kernel "GB/s" is the fewest bytes the op must move (inputs read once, outputs written once) over
the measured time, so it is comparable to the copy ceiling. Times are medians of
``triton.testing.do_bench``. Prints a table; writes every number as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

TOKENS, D, FF, VOCAB, HEADS, HEAD_DIM, BATCH, SEQ = 8 * 2048, 2048, 8192, 50304, 16, 128, 8, 2048
BF16 = torch.bfloat16


def bench(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """Median milliseconds of fn (CUDA events, after warm-up)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad_out: torch.Tensor | None = None):
    """A closure running fn forward and its backward to ``inputs`` (no .grad accumulation)."""

    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [x for x in inputs if x.requires_grad], grad_out)

    return run


def ceilings() -> dict:
    x = torch.randn(2**30 // 2 * 2, device="cuda", dtype=BF16)  # 2 GiB
    copy_ms = bench(lambda: torch.empty_like(x).copy_(x))
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    mm_ms = bench(lambda: a @ b)
    del x, a, b
    return {"copy_GBps": 2 * 2**31 / copy_ms / 1e6, "matmul_bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def row(op: str, impl: str, ms: float, bytes_: float | None = None, flops: float | None = None, **extra) -> dict:
    out = {"op": op, "impl": impl, "ms": ms, **extra}
    if bytes_ is not None:
        out["GBps"] = bytes_ / ms / 1e6
    if flops is not None:
        out["TFLOPs"] = flops / ms / 1e9
    return out


def bench_layernorm() -> list[dict]:
    from megatrain.kernels import layernorm_triton
    from megatrain.kernels.layernorm import add_layer_norm, layer_norm

    x = torch.randn(TOKENS, D, device="cuda", dtype=BF16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.ones(D, device="cuda", dtype=BF16, requires_grad=True)
    b = torch.zeros(D, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    nbytes = 5 * x.numel() * 2  # fwd: read x, write y; bwd: read x, dy, write dx
    rows = []
    for impl in ("reference", "fused"):
        ms = bench(fwd_bwd(lambda x, w, b: layer_norm(x, w, b, 1e-5, impl), [x, w, b], dy))
        rows.append(row("layernorm", impl, ms, nbytes))
    for per_sm in (2, 4, 8, 16):  # the backward's persistent grid: programs per SM
        layernorm_triton.BWD_PROGRAMS_PER_SM = per_sm
        ms = bench(fwd_bwd(lambda x, w, b: layer_norm(x, w, b, 1e-5, "fused"), [x, w, b], dy))
        rows.append(row("layernorm", f"fused, bwd {per_sm}/SM", ms, nbytes))
    layernorm_triton.BWD_PROGRAMS_PER_SM = 4

    def add_ln(impl):
        return lambda x, r, w, b: add_layer_norm(x, r, w, b, 1e-5, impl)

    # fwd: read x, r, write s, y; bwd: read s, dy, ds, write dx (one tensor serves x and r)
    nbytes = 8 * x.numel() * 2
    for impl in ("reference", "fused"):
        def run(impl=impl):
            y, s = add_ln(impl)(x, r, w, b)
            torch.autograd.grad([y, s], [x, r, w, b], [dy, dy])

        rows.append(row("add+layernorm", impl, bench(run), nbytes))
    return rows


def bench_gelu() -> list[dict]:
    from megatrain.kernels.gelu import bias_gelu

    x = torch.randn(TOKENS, FF, device="cuda", dtype=BF16, requires_grad=True)
    bias = torch.zeros(FF, device="cuda", dtype=torch.float32, requires_grad=True)  # fp32 param, as in training
    dy = torch.randn_like(x)
    nbytes = 5 * x.numel() * 2  # fwd: read x, write y; bwd: read x, dy, write dx
    rows = []
    for impl in ("reference", "fused"):
        # the reference's x + fp32 bias promotes to fp32: its grad_out must be fp32 too
        grad = dy.float() if impl == "reference" else dy
        ms = bench(fwd_bwd(lambda x, b: bias_gelu(x, b, impl), [x, bias], grad))
        rows.append(row("bias+gelu", impl, ms, nbytes))
    return rows


def bench_cross_entropy() -> list[dict]:
    from megatrain.kernels import cross_entropy as ce
    from megatrain.kernels.cross_entropy import lm_head_cross_entropy

    hidden = torch.randn(TOKENS, D, device="cuda", dtype=BF16, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, D, device="cuda")).requires_grad_()  # fp32 param under autocast
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    useful = 6 * TOKENS * VOCAB * D  # logits fwd (2NVd) + dhidden, dweight (4NVd)
    rows = []
    variants = [("reference", "reference", None), ("chunked", "chunked", None), ("fused", "fused", None),
                ("fused, dW via bf16 product", "fused", False)]
    for name, impl, out_dtype in variants:
        ce._addmm_out_dtype_works = out_dtype

        def run(impl=impl):
            with torch.autocast("cuda", dtype=BF16):
                loss = lm_head_cross_entropy(hidden, weight, targets, impl)
            torch.autograd.grad(loss, [hidden, weight])

        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
        rows.append(row("lm_head+CE", name, bench(run, rep_ms=400), flops=useful, peak_GB=peak_gb,
                        addmm_out_dtype=ce._addmm_out_dtype_works))
    ce._addmm_out_dtype_works = None
    return rows


def bench_attention() -> list[dict]:
    from megatrain.kernels.attention import attention_sdpa
    from megatrain.kernels.flex_attention import attention_flex

    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    q, k, v = [torch.randn(shape, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    dout = torch.randn_like(q)

    def flops(window: int | None) -> float:
        w = SEQ if window is None else window
        pairs = sum(min(i + 1, w) for i in range(SEQ))  # (query, key) pairs actually attended
        return 3.5 * 4 * BATCH * HEADS * HEAD_DIM * pairs  # fwd: QK^T + AV; bwd = 2.5x fwd

    cases = [("sdpa (cuDNN/flash), full causal", lambda q, k, v: attention_sdpa(q, k, v, None), None),
             ("flex, full causal", lambda q, k, v: attention_flex(q, k, v, None), None),
             ("flex, window 1024", lambda q, k, v: attention_flex(q, k, v, 1024), 1024),
             ("flex, window 512", lambda q, k, v: attention_flex(q, k, v, 512), 512),
             ("sdpa + dense mask, window 1024", lambda q, k, v: attention_sdpa(q, k, v, 1024), 1024)]
    rows = []
    for name, fn, window in cases:
        ms = bench(fwd_bwd(fn, [q, k, v], dout))
        rows.append(row("attention", name, ms, flops=flops(window)))
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
        ms = bench(lambda: fn(params, grads, ms_, vs, **hyper), rep_ms=500)
        rows.append(row("lamb step", name, ms, nbytes, params=n))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for all results")
    parser.add_argument("--only", default="layernorm,gelu,ce,attention,lamb")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    ceil = ceilings()
    suites = {"layernorm": bench_layernorm, "gelu": bench_gelu, "ce": bench_cross_entropy,
              "attention": bench_attention, "lamb": bench_lamb}
    rows: list[dict] = []
    for name in args.only.split(","):
        try:
            rows += suites[name]()
        except Exception as exc:  # one broken suite must not cost the others' numbers
            rows.append({"op": name, "impl": "FAILED", "error": f"{type(exc).__name__}: {exc}"[:500]})
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "shapes": dict(tokens=TOKENS, d=D, ff=FF, vocab=VOCAB, heads=HEADS, head_dim=HEAD_DIM, dtype="bf16"),
              "ceilings": ceil, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['device']}, torch {result['torch']}: copy {ceil['copy_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    print(f"{'op':<14} {'impl':<34} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'extra':>12}")
    for r in rows:
        if r["impl"] == "FAILED":
            print(f"{r['op']:<14} FAILED: {r['error']}")
            continue
        gbps = f"{r['GBps']:.0f}" if "GBps" in r else ""
        pct = f"{100 * r['GBps'] / ceil['copy_GBps']:.0f}" if "GBps" in r else ""
        tf = f"{r['TFLOPs']:.0f}" if "TFLOPs" in r else ""
        extra = f"{r['peak_GB']:.2f} GB" if "peak_GB" in r else ""
        print(f"{r['op']:<14} {r['impl']:<34} {r['ms']:>8.3f} {gbps:>7} {pct:>6} {tf:>8} {extra:>12}")


if __name__ == "__main__":
    main()
