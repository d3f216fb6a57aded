"""The ZeRO step's AdamW pass (``kernels/adamw_master_triton.py``) on a recipe's parameter shapes,
over launch shapes, beside torch's fused AdamW on the same fp32 master (one GPU).

The pass moves 28 bytes per parameter (bf16 gradient read; fp32 master and moments read and
written; bf16 weight written); the table gives each launch shape's time and bandwidth:

    python benchmarks/adamw_master_bench.py configs/moe-gpu-2b.yaml --out runs/adamw-master.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo
from bound import time_ms  # noqa: E402  (benchmarks/bound.py)
from megatrain.config import load_config  # noqa: E402
from megatrain.kernels.adamw_master import segments  # noqa: E402
from megatrain.kernels.adamw_master_triton import adamw_master_fused  # noqa: E402
from megatrain.model import GPT  # noqa: E402

# (block, num_warps, sizes hinted as multiples of 16)
SHAPES = [(1024, 8, False), (1024, 8, True), (512, 4, False), (512, 4, True), (2048, 8, True), (2048, 16, True),
          (1024, 4, True), (4096, 16, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--out", default="runs/adamw-master.json")
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(cfg.model).parameters()]
    device = torch.device("cuda")
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    n = sum(g.numel() for g in grads)
    master = torch.randn(n, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.rand_like(master)
    weight16 = torch.empty(n, device=device, dtype=torch.bfloat16)
    step, clip = torch.ones((), device=device), torch.full((), 1.5, device=device)
    segs = segments(grads)
    rows = {}
    for block, warps, hint in SHAPES:
        ms = time_ms(lambda: adamw_master_fused(master, exp_avg, exp_avg_sq, weight16, segs, step, 1e-4, 0.9, 0.95,
                                                1e-8, 0.1, clip, block=block, num_warps=warps, hint_numel=hint), device)
        rows[f"block {block}, {warps} warps{', sizes hinted' if hint else ''}"] = {"ms": ms, "tb_s": 28 * n / ms / 1e9}
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    master.grad = flat
    opt = torch.optim.AdamW([master], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ms = time_ms(opt.step, device)
    rows["torch fused AdamW (fp32 gradient, no bf16 write)"] = {"ms": ms, "tb_s": 32 * n / ms / 1e9}
    print(f"{n / 1e9:.2f}B parameters on {torch.cuda.get_device_name()}")
    for name, r in rows.items():
        print(f"  {name:50s} {r['ms']:7.2f} ms  {r['tb_s']:5.2f} TB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": args.config, "device": torch.cuda.get_device_name(),
                                          "parameters": n, "rows": rows}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
