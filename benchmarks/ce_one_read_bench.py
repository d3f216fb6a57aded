"""The LM-head loss kernel (``kernels/cross_entropy_triton.py``) at moe-gpu-2b's micro-batch of 32
(logits [65536, 50304] bf16, 6.6 GB), beside a candidate defined here that reads each row once
(one GPU).

The library's kernel walks a row in blocks of 4096 twice: an online max / sum-exp pass, then the
gradient pass, which reads the row again: two reads and one write of the logits (4.92 ms on an
H200, ``benchmarks/results/ce-launch-sweep-h200.json``). The candidate loads the whole row (its vocabulary padded to
a power of two) into registers in one load and writes dlogits from them: one read and one write,
if the row fits the registers of its warps without spilling. It is checked against the library
before it is timed, and moves into the library only if it wins.

    python benchmarks/ce_one_read_bench.py --out runs/ce-one-read.json
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
from megatrain.kernels.cross_entropy import IGNORE_INDEX  # noqa: E402
from megatrain.kernels.cross_entropy_triton import softmax_cross_entropy_chunk_triton  # noqa: E402

ROWS, VOCAB = 32 * 2048, 50304  # moe-gpu-2b: micro-batch 32 of 2048 tokens
WARPS = (8, 16, 32)


@triton.jit
def _softmax_ce_row_kernel(LOGITS, TARGETS, LOSS, SCALE, ignore_index, V: tl.constexpr, BLOCK: tl.constexpr):
    """The library's _softmax_ce_kernel (NEED_GRAD) with the row held in registers: one read."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * V
    cols = tl.arange(0, BLOCK)
    in_row = cols < V
    x = tl.load(base + cols, mask=in_row, other=-float("inf"))  # kept in the logits' dtype
    m = tl.max(x.to(tl.float32), axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x.to(tl.float32) - m), axis=0))
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(base + safe_target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
    scale = tl.where(valid, tl.load(SCALE), 0.0)
    grad = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == safe_target, 1.0, 0.0)
    tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=in_row)


def one_read(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, num_warps: int):
    """softmax_cross_entropy_chunk_triton's contract (need_grad), through the candidate."""
    C, V = logits.shape
    loss = torch.empty(C, dtype=torch.float32, device=logits.device)
    _softmax_ce_row_kernel[(C,)](logits, targets, loss, scale.reshape(1).float(), IGNORE_INDEX, V=V,
                                 BLOCK=triton.next_power_of_2(V), num_warps=num_warps)
    return loss.sum(), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/ce-one-read.json")
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args()
    device = torch.device("cuda")
    source = torch.randn(args.rows, VOCAB, device=device, dtype=torch.bfloat16) * 3
    targets = torch.randint(0, VOCAB, (args.rows,), device=device)
    targets[::7] = IGNORE_INDEX
    scale = 1.0 / (targets != IGNORE_INDEX).sum().float()
    logits = source.clone()  # the kernels overwrite it with dlogits; timing needs no fresh copy
    gbytes = logits.numel() * logits.element_size() / 1e9
    copy = torch.empty_like(logits)
    copy_ms = time_ms(lambda: copy.copy_(source), device)
    rows = {"copy (one read + one write: the one-read floor)": {"ms": copy_ms, "tb_s": 2 * gbytes / copy_ms}}

    def library():
        return softmax_cross_entropy_chunk_triton(logits, targets, scale, True, IGNORE_INDEX)

    ms = time_ms(library, device)
    rows["library (two reads, one write)"] = {"ms": ms, "tb_s": 3 * gbytes / ms}
    want_loss, want_grad = softmax_cross_entropy_chunk_triton(source.clone(), targets, scale, True, IGNORE_INDEX)
    for warps in WARPS:
        got_loss, got_grad = one_read(source.clone(), targets, scale, warps)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-2, atol=1e-7)  # bf16, one rounding apart
        ms = time_ms(lambda: one_read(logits, targets, scale, warps), device)
        rows[f"candidate, one read, {warps} warps"] = {"ms": ms, "tb_s": 2 * gbytes / ms}
    print(f"loss + dlogits at [{args.rows}, {VOCAB}] bf16 on {torch.cuda.get_device_name()}")
    for name, r in rows.items():
        print(f"  {name:50s} {r['ms']:7.3f} ms  {r['tb_s']:5.2f} TB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": [args.rows, VOCAB],
                                          "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
