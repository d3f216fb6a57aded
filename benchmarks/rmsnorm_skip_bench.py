"""The backward of a serial MoE block's first RMSNorm (``kernels/rmsnorm.rms_norm_with_skip``,
the Triton kernel that carries the skip connection) at moe-gpu-2b's shape, over its persistent
grid's programs per SM, beside a candidate defined here that loads several rows at once, and the
copy ceiling (one GPU).

Bytes: the backward reads x, dy and the skip's gradient and writes dx: 4 passes of [tokens, d]. In
the moe-gpu-2b profile (``mfu-moe-step-profile-hostwaits-h200.json``) it ran at about 2.3 TB/s,
with 4 programs per SM each walking its rows one at a time. The candidate is checked against the
library's kernel before it is timed; it moves into ``rmsnorm_triton.py`` only if it wins.

    python benchmarks/rmsnorm_skip_bench.py --out runs/rmsnorm-skip.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from bound import time_ms  # noqa: E402  (benchmarks/bound.py)
from megatrain.kernels import rmsnorm_triton, sm_count  # noqa: E402
from megatrain.kernels.layernorm_triton import _block_and_warps  # noqa: E402

TOKENS, D = 32 * 2048, 1024  # moe-gpu-2b: micro-batch 32 of 2048 tokens, d_model 1024
PER_SM = (2, 4, 8, 16, 32)
CANDIDATES = [(4, 2), (4, 4), (8, 2), (8, 4)]  # (programs per SM, rows at once)


@triton.jit
def _rms_bwd_tile_kernel(X, DY, DX, DSUM, W, RSTD, DW_PART, M, N, ROWS_PER_PROGRAM: tl.constexpr,
                         ROWS_PER_ITER: tl.constexpr, BLOCK_N: tl.constexpr):
    """rmsnorm_triton._rms_bwd_kernel (with the skip's gradient) on [ROWS_PER_ITER, BLOCK_N] tiles."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM, ROWS_PER_ITER):
        local = i + tl.arange(0, ROWS_PER_ITER)[:, None]  # [R, 1] rows of this program
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + local
        in_rows = (row < M) & (local < ROWS_PER_PROGRAM)
        tile_mask = mask[None, :] & in_rows
        offs = row * N + cols[None, :]
        x = tl.load(X + offs, mask=tile_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=tile_mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=in_rows, other=0.0)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=1)[:, None] / N
        dx = (wdy - xhat * c) * rstd + tl.load(DSUM + offs, mask=tile_mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=tile_mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PART + pid * N + cols, dw, mask=mask)


def tile_backward(x2d, dy, dskip, weight, rstd, per_sm: int, rows_at_once: int):
    """rmsnorm_triton._backward's grid and outputs, through the candidate kernel."""
    M, N = x2d.shape
    block, warps = _block_and_warps(N)
    programs = max(1, min(M, per_sm * sm_count(x2d.device)))
    rows_per_program = triton.cdiv(M, programs)
    programs = triton.cdiv(M, rows_per_program)
    dx = torch.empty_like(x2d)
    dw_part = torch.empty((programs, N), dtype=torch.float32, device=x2d.device)
    _rms_bwd_tile_kernel[(programs,)](x2d, dy, dx, dskip, weight, rstd, dw_part, M, N, ROWS_PER_PROGRAM=rows_per_program,
                                      ROWS_PER_ITER=rows_at_once, BLOCK_N=block, num_warps=warps)
    return dx, dw_part.sum(0).to(weight.dtype)


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

    default = rmsnorm_triton.BWD_PROGRAMS_PER_SM
    try:
        for per_sm in PER_SM:
            rmsnorm_triton.BWD_PROGRAMS_PER_SM = per_sm
            ms = time_ms(library, device)
            rows[f"library, {per_sm} programs/SM{' (default)' if per_sm == default else ''}"] = {
                "ms": ms, "tb_s": gbytes / ms}
    finally:
        rmsnorm_triton.BWD_PROGRAMS_PER_SM = default
    want_dx, want_dw = library()
    for per_sm, rows_at_once in CANDIDATES:
        got_dx, got_dw = tile_backward(x, dy, dskip, w, rstd, per_sm, rows_at_once)
        torch.testing.assert_close(got_dx, want_dx, rtol=1e-2, atol=1e-2)  # bf16 outputs, one rounding apart
        torch.testing.assert_close(got_dw.float(), want_dw.float(), rtol=2e-2, atol=1.0)  # summed in other orders
        ms = time_ms(lambda: tile_backward(x, dy, dskip, w, rstd, per_sm, rows_at_once), device)
        rows[f"candidate, {per_sm} programs/SM, {rows_at_once} rows at once"] = {"ms": ms, "tb_s": gbytes / ms}
    print(f"backward at [{TOKENS}, {D}] bf16 on {torch.cuda.get_device_name()}")
    for name, r in rows.items():
        print(f"  {name:45s} {r['ms']:7.3f} ms  {r['tb_s']:5.2f} TB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [TOKENS, D],
                                          "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
