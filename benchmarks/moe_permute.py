"""The MoE layer's memory-bound passes at moe-gpu-2b's shapes, each beside the version it replaced:

    python benchmarks/moe_permute.py --out runs/moe-permute.json

- the dispatch (x [N, d] -> the experts' rows [N k, d]) and the weighted combine's backward
  (``kernels/moe_permute_triton.py``), walking the tokens (each reads its own row once) against
  walking the experts' rows (``rows[r] = x[order[r] // k]``: each token's row read k times, in an
  order that jumps over all of x), the formulation the engine had before (copied here, as the
  baseline);
- the combine's backward with the router's weights applied inside the experts (a plain copy of
  dout to each row; ``model/moe.py``'s WEIGHTS_IN_EXPERTS) against the weighted one (which also
  reads every expert output for the weights' gradient), and SwiGLU forward + backward with and
  without that row scale (``kernels/swiglu_triton.py``).

Each pass's floor is the bytes it must move (every input read once, every output written once)
over ``--copy-tbs``, the device-to-device copy rate (4.22 TB/s read + write, measured on an
H200). At ``--tokens`` 16,384 (micro-batch 8) x is 32 MB and fits an H200's 50-MB L2;
at 65,536 (micro-batch 32, the recipe's benchmark) it is 128 MB and does not. Per row: the
median of ``--iters`` CUDA-event timings after a warm-up, and the largest difference from the
row it replaces. ``--sweep`` also times each token-major kernel at every warp count in SWEEP and
prints the fastest. Prints a table and writes the JSON; every row
runs in this one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from moe_gemm import add_layer_arguments, cuda_ms, write_report  # noqa: E402  (benchmarks/moe_gemm.py)


def floor_bytes(tokens: int, k: int, d: int, ff: int) -> dict[str, int]:
    """The fewest bytes each pass moves in bf16 (fp32 weights and their gradients: 4 bytes a row)."""
    n, m = tokens, tokens * k
    return {"dispatch": 2 * (n * d + m * d),  # read x, write the rows
            "combine": 2 * (m * d + n * d),  # read the rows, write out (and the dispatch's backward)
            "combine_bwd_weighted": 2 * (n * d + 2 * m * d) + 8 * m,  # read dout and y, write dy; w, dw
            "combine_bwd_plain": 2 * (n * d + m * d),  # read dout, write dy
            "swiglu_fwd_bwd": 2 * (m * 2 * ff + m * ff) + 2 * (m * 2 * ff + m * ff + m * 2 * ff),
            "swiglu_fwd_bwd_scaled": 2 * (3 * m * ff + 5 * m * ff) + 12 * m}


def expert_major_kernels():
    """The formulation the engine had before, as the baseline: one program per expert row."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(X, ORDER, OUT, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        src = (tl.load(ORDER + r) // K).to(tl.int64)
        tl.store(OUT + r.to(tl.int64) * D + cols, tl.load(X + src * D + cols, mask=mask), mask=mask)

    @triton.jit
    def combine_bwd(DOUT, Y, ORDER, W, DY, DW, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        slot = tl.load(ORDER + r)
        g = tl.load(DOUT + (slot // K).to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + r.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DY + r.to(tl.int64) * D + cols, (g * tl.load(W + slot)).to(DY.dtype.element_ty), mask=mask)
        tl.store(DW + slot, tl.sum(g * y, axis=0))

    return gather_rows, combine_bwd


def measure(args: argparse.Namespace, dev: str = "cuda", time_ms=cuda_ms) -> list[dict]:
    """Every row (``dev`` cpu with ``TRITON_INTERPRET=1``: the tests' check that the rows compare
    what they say, at a toy size)."""
    from megatrain.kernels import moe_permute_triton as mp
    from megatrain.kernels.moe_permute import group_order, row_of_slot
    from megatrain.kernels.swiglu_triton import swiglu_fused

    torch.manual_seed(0)
    bf16, k, d = torch.bfloat16, args.top_k, args.d
    n, m = args.tokens, args.tokens * args.top_k
    x = torch.randn(n, d, device=dev, dtype=bf16)
    dout = torch.randn(n, d, device=dev, dtype=bf16)
    y = torch.randn(m, d, device=dev, dtype=bf16)
    w = torch.rand(m, device=dev)
    choice = torch.rand(n, args.experts, device=dev).topk(k, dim=-1).indices.flatten()  # k distinct per token
    order = group_order(choice, args.experts)
    inverse = row_of_slot(order)
    launch = mp.launch_options("scatter_rows", d)  # the engine's default warps, for the baseline kernels
    gather_rows, combine_bwd_rows = expert_major_kernels()

    def dispatch_expert_major():
        out = torch.empty(m, d, device=dev, dtype=bf16)
        gather_rows[(m,)](x, order, out, d, K=k, **launch)
        return out

    def combine_bwd(token_major: bool):
        if token_major:
            return mp.combine_bwd(dout, y, inverse, w, k)[0]
        dy, dw = torch.empty_like(y), torch.empty_like(w)
        combine_bwd_rows[(m,)](dout, y, order, w, dy, dw, d, K=k, **launch)
        return dy

    h = torch.randn(m, 2 * args.ff, device=dev, dtype=bf16, requires_grad=True)
    dh_out = torch.randn(m, args.ff, device=dev, dtype=bf16)
    scale = w.clone().requires_grad_()

    def swiglu_step(scaled: bool):
        out = swiglu_fused(h, scale if scaled else None)
        return torch.autograd.grad(out, [h, scale] if scaled else [h], dh_out)[0]

    floors = floor_bytes(n, k, d, args.ff)
    token_major = {"scatter_rows": lambda: mp.scatter_rows(x, inverse, k),
                   "gather_sum": lambda: mp.gather_sum(y, inverse, k, w), "combine_bwd": lambda: combine_bwd(True)}
    passes = [  # (name, floor key, fn, the baseline it replaces)
        ("dispatch, expert-major gather (before)", "dispatch", dispatch_expert_major, None),
        ("dispatch, token-major", "dispatch", token_major["scatter_rows"], dispatch_expert_major),
        ("combine forward (gather-sum)", "combine", token_major["gather_sum"], None),
        ("combine backward weighted, expert-major (before)", "combine_bwd_weighted", lambda: combine_bwd(False), None),
        ("combine backward weighted, token-major", "combine_bwd_weighted", token_major["combine_bwd"],
         lambda: combine_bwd(False)),
        ("combine backward plain (weights in the experts)", "combine_bwd_plain",
         lambda: mp.scatter_rows(dout, inverse, k), None),
        ("SwiGLU forward + backward", "swiglu_fwd_bwd", lambda: swiglu_step(False), None),
        ("SwiGLU forward + backward with the row scale", "swiglu_fwd_bwd_scaled", lambda: swiglu_step(True), None),
    ]
    rows = []
    for name, key, fn, baseline in passes:
        row = {"name": name, **timed(fn, floors[key], args, time_ms)}
        if baseline is not None:
            row["max_abs_diff"] = (fn().float() - baseline().float()).abs().max().item()
        rows.append(row)
    if getattr(args, "sweep", False):
        keys = {"scatter_rows": "dispatch", "gather_sum": "combine", "combine_bwd": "combine_bwd_weighted"}
        rows += sweep(args, {kernel: (fn, floors[keys[kernel]]) for kernel, fn in token_major.items()}, time_ms)
    return rows


def timed(fn, floor: int, args: argparse.Namespace, time_ms) -> dict:
    """fn's median time, its floor (``floor`` bytes at the copy rate) and the rate it moved them at."""
    ms = time_ms(fn, args.iters)
    return {"ms": ms, "floor_ms": floor / (args.copy_tbs * 1e12) * 1e3, "tb_s": floor / (ms * 1e-3) / 1e12}


def sweep(args: argparse.Namespace, kernels: dict, time_ms) -> list[dict]:
    """Each token-major kernel (name -> (fn, floor bytes)) at every warp count of SWEEP
    (``kernels/moe_permute_triton.WARPS``), the engine's own first; each row's output must equal
    the engine's."""
    from megatrain.kernels import moe_permute_triton as mp

    rows = []
    for kernel, (fn, floor) in kernels.items():
        engine = mp.WARPS[kernel]
        want = fn()
        for warps in [engine, *(w for w in SWEEP if w != engine)]:
            mp.WARPS[kernel] = warps
            try:
                rows.append({"name": f"sweep {kernel}: {warps or 'default'} warps", "kernel": kernel,
                             "warps": warps, **timed(fn, floor, args, time_ms),
                             "max_abs_diff": (fn().float() - want.float()).abs().max().item()})
            finally:
                mp.WARPS[kernel] = engine
    return rows


SWEEP = [2, 4, 8]  # warps a program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_arguments(parser, tokens=65536)
    parser.add_argument("--copy-tbs", type=float, default=4.22, help="device-to-device copy rate, TB/s (read + write)")
    parser.add_argument("--sweep", action="store_true", help="also each kernel at every warp count of SWEEP")
    parser.add_argument("--out", default="runs/moe-permute.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_permute.py needs a CUDA GPU (its Triton kernels run there)")
    rows = measure(args)
    n, k, d = args.tokens, args.top_k, args.d
    print(f"{torch.cuda.get_device_name()}: {n} tokens, top-{k} of {args.experts}, d {d}, width {args.ff} (bf16); "
          f"floors at {args.copy_tbs} TB/s")
    for row in rows:
        diff = f"  max |diff| {row['max_abs_diff']:.3g}" if "max_abs_diff" in row else ""
        print(f"  {row['name']:<52} {row['ms']:7.3f} ms  floor {row['floor_ms']:6.3f}  {row['tb_s']:5.2f} TB/s{diff}")
    for kernel in ("scatter_rows", "gather_sum", "combine_bwd"):
        swept = [row for row in rows if row.get("kernel") == kernel]
        if swept:
            best = min(swept, key=lambda row: row["ms"])
            print(f"  fastest {kernel}: {best['warps'] or 'default'} warps {best['ms']:.3f} ms (the engine's "
                  f"{swept[0]['warps'] or 'default'}: {swept[0]['ms']:.3f} ms)")
    write_report(args, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
