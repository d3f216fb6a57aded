"""The backward of a serial MoE block's first RMSNorm (``kernels/rmsnorm.rms_norm_with_skip``,
the Triton kernel that carries the skip connection) at moe-gpu-2b's shape, over its persistent
grid's launch settings (programs per SM, rows each program holds at once), beside the copy
ceiling (one GPU).

Bytes: the backward reads x, dy and the skip's gradient and writes dx: 4 passes of [tokens, d].
Every setting is checked against the library's default before it is timed.

    python benchmarks/rmsnorm_skip_bench.py --out runs/rmsnorm-skip.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from bound import time_ms  # noqa: E402  (benchmarks/bound.py)
from megatrain.kernels import rmsnorm_triton  # noqa: E402

TOKENS, D = 32 * 2048, 1024  # moe-gpu-2b: micro-batch 32 of 2048 tokens, d_model 1024
SETTINGS = [(4, 1), (8, 1), (4, 4), (8, 2), (8, 4), (8, 8), (16, 2), (16, 4)]  # (programs per SM, rows at once)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/rmsnorm-skip.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(TOKENS, D, device=device, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(D, device=device, dtype=torch.bfloat16)
    dy, dskip = torch.randn_like(x), torch.randn_like(x)
    _, _, rstd = rmsnorm_triton._forward(x, None, w, 1e-5, x.dtype)
    gbytes = 4 * x.numel() * x.element_size() / 1e9
    copy = torch.empty_like(x)
    copy_ms = time_ms(lambda: copy.copy_(dy), device)
    rows = {"copy (read + write one [tokens, d])": {"ms": copy_ms, "tb_s": gbytes / 2 / copy_ms}}

    def library():
        return rmsnorm_triton._backward(x, dy, dskip, w, rstd, x.dtype)

    default = rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_AT_ONCE
    want_dx, want_dw = library()
    try:
        for per_sm, rows_at_once in SETTINGS:
            rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_AT_ONCE = per_sm, rows_at_once
            got_dx, got_dw = library()
            torch.testing.assert_close(got_dx, want_dx, rtol=1e-2, atol=1e-2)  # bf16 outputs, one rounding apart
            torch.testing.assert_close(got_dw.float(), want_dw.float(), rtol=2e-2, atol=1.0)  # summed in other orders
            ms = time_ms(library, device)
            mark = " (default)" if (per_sm, rows_at_once) == default else ""
            rows[f"{per_sm} programs/SM, {rows_at_once} rows at once{mark}"] = {"ms": ms, "tb_s": gbytes / ms}
    finally:
        rmsnorm_triton.BWD_PROGRAMS_PER_SM, rmsnorm_triton.BWD_ROWS_AT_ONCE = default
    print(f"backward at [{TOKENS}, {D}] bf16 on {torch.cuda.get_device_name()}")
    for name, r in rows.items():
        print(f"  {name:45s} {r['ms']:7.3f} ms  {r['tb_s']:5.2f} TB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [TOKENS, D],
                                          "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
