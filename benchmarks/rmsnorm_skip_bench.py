"""A serial MoE block's first RMSNorm (``kernels/rmsnorm.rms_norm_with_skip``, the Triton kernel
that carries the skip connection) at moe-gpu-2b's shape, forward + backward, over the backward's
persistent-grid size (programs per SM) and the rows its programs load at once
(``rmsnorm_triton.BWD_ROWS_PER_ITER``), beside the copy ceiling (one GPU).

Bytes: the forward reads x and writes y; the backward reads x, dy and the skip's gradient and
writes dx: 6 passes of [tokens, d]. In the moe-gpu-2b profile (``mfu-moe-step-profile-hostwaits-h200.json``)
the backward ran at about 2.3 TB/s, with 4 programs per SM each walking its rows one at a time.

    python benchmarks/rmsnorm_skip_bench.py --out runs/rmsnorm-skip.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from megatrain.kernels import rmsnorm_triton  # noqa: E402
from megatrain.kernels.rmsnorm import rms_norm_with_skip  # noqa: E402

TOKENS, D = 32 * 2048, 1024  # moe-gpu-2b: micro-batch 32 of 2048 tokens, d_model 1024
SWEEP = [(per_sm, 1) for per_sm in (2, 4, 8, 16, 32)] + [(4, 2), (4, 4), (8, 2), (8, 4)]  # (programs/SM, rows at once)


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/rmsnorm-skip.json")
    args = parser.parse_args()
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy, dskip = torch.randn_like(x), torch.randn_like(x)
    copy = torch.empty_like(x)
    copy_ms = time_ms(lambda: copy.copy_(dy))
    rows = {"copy (read + write one [tokens, d])": {"ms": copy_ms, "tb_s": 2 * x.numel() * 2 / copy_ms / 1e9}}

    def run():
        y, skip = rms_norm_with_skip(x, w, 1e-5, "fused")
        torch.autograd.grad([y, skip], [x, w], [dy, dskip])

    default = rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_PER_ITER
    try:
        for per_sm, rows_at_once in SWEEP:
            rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_PER_ITER = per_sm, rows_at_once
            ms = time_ms(run)
            name = f"fwd + bwd, {per_sm} programs/SM, {rows_at_once} row(s) at once"
            rows[name + (" (default)" if (per_sm, rows_at_once) == default else "")] = {
                "ms": ms, "tb_s": 6 * x.numel() * 2 / ms / 1e9}
    finally:
        rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_PER_ITER = default
    print(f"[{TOKENS}, {D}] bf16 on {torch.cuda.get_device_name()}")
    for name, r in rows.items():
        print(f"  {name:45s} {r['ms']:7.3f} ms  {r['tb_s']:5.2f} TB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [TOKENS, D],
                                          "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
