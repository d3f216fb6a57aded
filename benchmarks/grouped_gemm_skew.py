"""The experts' grouped GEMMs (CUTLASS, ``torch._grouped_mm``) against routing skew and weight
alignment, at one moe-gpu-2b layer of micro-batch 16 (issue 32):

    python benchmarks/grouped_gemm_skew.py --out runs/grouped-gemm-skew.json

- skew: each token's top-8 experts drawn without replacement from a Zipf law over the 64 experts
  (exponent 0: uniform; 1.5: the busiest expert gets ~8x the mean), which is how an untrained
  router on real text looks (max/mean 2-6 per layer in the trainer's first steps);
- alignment: the expert weights at a 0-, 16- or 64-byte offset from a 256-byte boundary (a
  parameter inside a flat buffer lands where the numels before it put it).

Per row the median of ``--iters`` CUDA-event timings of the five GEMMs a layer runs: both
projections forward, the first one's input gradient, both weight gradients. Prints a table and
writes the JSON; one process, one GPU.
"""

from __future__ import annotations

import argparse

import torch
from moe_gemm import add_layer_arguments, cuda_ms, write_report  # benchmarks/moe_gemm.py: the same layer, timed alike


def offset_tensor(shape: tuple[int, ...], offset_bytes: int) -> torch.Tensor:
    """A bf16 tensor whose data starts ``offset_bytes`` past an allocation's (aligned) start."""
    n = 1
    for s in shape:
        n *= s
    buffer = torch.randn(n + 256, device="cuda", dtype=torch.bfloat16)
    return buffer[offset_bytes // 2: offset_bytes // 2 + n].view(*shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_arguments(parser, tokens=32768)  # micro-batch 16
    parser.add_argument("--out", default="runs/grouped-gemm-skew.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("grouped_gemm_skew.py needs a CUDA GPU (CUTLASS's grouped GEMM runs there)")
    n, k, e, d, ff = args.tokens, args.top_k, args.experts, args.d, args.ff
    m = n * k
    generator = torch.Generator().manual_seed(0)
    rows, act = torch.randn(m, d, device="cuda", dtype=torch.bfloat16), torch.randn(m, ff, device="cuda", dtype=torch.bfloat16)
    dy, dh = torch.randn(m, d, device="cuda", dtype=torch.bfloat16), torch.randn(m, 2 * ff, device="cuda", dtype=torch.bfloat16)
    results = []
    for exponent in (0.0, 0.5, 1.0, 1.5):
        law = torch.arange(1, e + 1, dtype=torch.float64) ** -exponent
        choice = torch.multinomial((law / law.sum()).expand(n, e), k, replacement=False, generator=generator)
        counts = torch.bincount(choice.reshape(-1), minlength=e).cuda()
        offs = torch.cumsum(counts, 0).to(torch.int32)
        for offset in (0, 16, 64):
            fc, proj = offset_tensor((e, 2 * ff, d), offset), offset_tensor((e, d, ff), offset)
            gemms = {
                "fc forward": lambda: torch._grouped_mm(rows, fc.transpose(-2, -1), offs=offs),
                "proj forward": lambda: torch._grouped_mm(act, proj.transpose(-2, -1), offs=offs),
                "fc input grad": lambda: torch._grouped_mm(dh, fc, offs=offs),
                "fc weight grad": lambda: torch._grouped_mm(dh.t(), rows, offs=offs),
                "proj weight grad": lambda: torch._grouped_mm(dy.t(), act, offs=offs),
            }
            row = {"zipf_exponent": exponent, "max_over_mean": (counts.max() / counts.float().mean()).item(),
                   "weight_offset_bytes": offset, "ms": {name: cuda_ms(fn, args.iters) for name, fn in gemms.items()}}
            row["total_ms"] = sum(row["ms"].values())
            results.append(row)
    device = torch.cuda.get_device_name()
    print(f"{device}: {n} tokens, top-{k} of {e}, d {d}, width {ff} (bf16); ms per call")
    names = list(results[0]["ms"])
    print(f"{'max/mean':>9} {'offset':>7} " + "".join(f"{name:>17}" for name in names) + f"{'total':>9}")
    for row in results:
        print(f"{row['max_over_mean']:9.2f} {row['weight_offset_bytes']:6d}B "
              + "".join(f"{row['ms'][name]:17.3f}" for name in names) + f"{row['total_ms']:9.3f}")
    write_report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
