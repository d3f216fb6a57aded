"""The experts' first projection, three passes against one fused Triton kernel, and its weight
gradient, CUTLASS on the gathered copy against the gather inside the GEMM (issue 32's lever):

    python benchmarks/moe_gemm.py --out runs/moe-gemm.json

- three passes (what the model runs): the dispatch gather (``kernels/moe_permute``, Triton), the
  CUTLASS grouped GEMM (``torch._grouped_mm``) and SwiGLU (``kernels/swiglu``, Triton);
- fused (``kernels/moe_gemm_triton``): the gather in the GEMM's loads and SwiGLU in its epilogue,
  at each of a few tile shapes.

moe-gpu-2b's layer by default (16,384 tokens, top-8 of 64 experts, d 1024, width 640, bf16, the
experts chosen uniformly at random). The weight gradient's baseline is the grouped GEMM alone: the
gathered copy it reads is kept from the forward today, which the fused pair would no longer write.
Per row: the median of ``--iters`` timed calls (CUDA events) after a warm-up, the GEMM's TFLOP/s
(2 M d 2 ff / time), and the largest difference from the three passes' output. Prints a table and
writes the JSON; both rows run in this one process on one GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from bound import time_ms  # noqa: E402  (benchmarks/bound.py)

TILES = [(128, 64, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 32, 4, 4),
         (64, 128, 64, 4, 4)]
WGRAD_TILES = [(128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4),
               (128, 64, 64, 4, 3)]


def cuda_ms(fn, iters: int) -> float:
    """The median of ``iters`` CUDA-event timings of ``fn`` after 3 warm-up calls (``bound.time_ms``)."""
    return time_ms(fn, torch.device("cuda"), iters, warmup=3)


def add_layer_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    """moe-gpu-2b's MoE layer shape (``tokens`` routed top-8 of 64 experts, d 1024, width 640) and
    the timed calls per row: the options both layer benchmarks share (this and grouped_gemm_skew)."""
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--ff", type=int, default=640)
    parser.add_argument("--iters", type=int, default=20)


def write_report(args: argparse.Namespace, rows: list[dict]) -> None:
    """The JSON both layer benchmarks write: the GPU, torch, the options and the rows."""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "args": vars(args), "rows": rows}, indent=1))
    print(f"JSON: {args.out}")


def gemm_tflops(rows: int, d: int, ff: int, ms: float) -> float:
    """The first projection's FLOPs (gate and up: 2 x rows x d x 2 ff) per second, in TFLOP/s."""
    return 2 * rows * d * 2 * ff / (ms * 1e-3) / 1e12


def fused_row(name: str, want: torch.Tensor, iters: int, fn) -> dict:
    """One fused kernel's row: its largest difference from ``want`` and its time, or the error of
    a tile shape this GPU cannot run (shared memory)."""
    row = {"name": name}
    try:
        row["max_abs_diff"] = (fn().float() - want.float()).abs().max().item()
        row["ms"] = cuda_ms(fn, iters)
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the other shapes still run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_arguments(parser, tokens=16384)
    parser.add_argument("--out", default="runs/moe-gemm.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemm.py needs a CUDA GPU (CUTLASS's grouped GEMM and the Triton kernels run there)")
    from megatrain.kernels.moe_gemm import gathered_swiglu_mm, gathered_wgrad
    from megatrain.kernels.moe_permute import Slots, group_order, permute, row_of_slot
    from megatrain.kernels.swiglu import swiglu

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(args.tokens, args.d, device=dev, dtype=bf16)
    fc = torch.randn(args.experts, 2 * args.ff, args.d, device=dev, dtype=bf16) / args.d**0.5
    choice = torch.randint(0, args.experts, (args.tokens * args.top_k,), device=dev)
    order = group_order(choice, args.experts)
    slots = Slots(order, row_of_slot(order), args.top_k)
    counts = torch.bincount(choice, minlength=args.experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    row_src, m = order // args.top_k, order.numel()

    def three_passes():
        rows = permute(x, slots, "fused")
        return swiglu(torch._grouped_mm(rows, fc.transpose(-2, -1), offs=offsets), "fused")

    dh = torch.randn(m, 2 * args.ff, device=dev, dtype=bf16)
    rows_kept = permute(x, slots, "fused")  # the copy today's forward keeps for this

    def cutlass_wgrad():
        return torch._grouped_mm(rows_kept.transpose(-2, -1), dh, offs=offsets)  # [E, d, 2 ff]

    h_kept = torch._grouped_mm(rows_kept, fc.transpose(-2, -1), offs=offsets)
    rows_out = [{"name": "three passes (gather, CUTLASS grouped GEMM, SwiGLU)", "ms": cuda_ms(three_passes, args.iters)},
                {"name": "  of which the gather", "ms": cuda_ms(lambda: permute(x, slots, "fused"), args.iters)},
                {"name": "  of which the grouped GEMM", "ms": cuda_ms(
                    lambda: torch._grouped_mm(rows_kept, fc.transpose(-2, -1), offs=offsets), args.iters)},
                {"name": "  of which SwiGLU", "ms": cuda_ms(lambda: swiglu(h_kept, "fused"), args.iters)}]
    want = three_passes()
    for bm, bn, bk, warps, stages in TILES:
        rows_out.append(fused_row(f"fused {bm}x{bn}x{bk}, {warps} warps, {stages} stages", want, args.iters,
                                  lambda t=(bm, bn, bk, warps, stages): gathered_swiglu_mm(x, row_src, counts, fc, *t)[0]))
    rows_out.append({"name": "weight gradient: CUTLASS grouped GEMM on the kept copy",
                     "ms": cuda_ms(cutlass_wgrad, args.iters)})
    want_wgrad = cutlass_wgrad().transpose(-2, -1)
    for bn, bk, br, warps, stages in WGRAD_TILES:
        rows_out.append(fused_row(f"weight gradient fused {bn}x{bk}, rows {br}, {warps} warps, {stages} stages",
                                  want_wgrad, args.iters,
                                  lambda t=(bn, bk, br, warps, stages): gathered_wgrad(x, row_src, counts, dh, *t)))
    device = torch.cuda.get_device_name()
    print(f"{device}: {args.tokens} tokens, top-{args.top_k} of {args.experts}, d {args.d}, width {args.ff} (bf16)")
    for row in rows_out:
        if "ms" in row:
            row["gemm_tflops"] = gemm_tflops(m, args.d, args.ff, row["ms"])
            print(f"  {row['name']:<55} {row['ms']:8.3f} ms {row['gemm_tflops']:7.1f} TFLOP/s"
                  + (f"  max |diff| {row['max_abs_diff']:.3g}" if "max_abs_diff" in row else ""))
        else:
            print(f"  {row['name']:<55} {row['error']}")
    write_report(args, rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
