"""The shared expert beside the expert-parallel all-to-all, on and off (issue 32): one MoE layer's
forward + backward on ``--nproc`` ranks (gloo on CPU, NCCL on GPUs), experts spread over them,
``parallel.overlap.ep_shared_expert`` alternated in the same processes.

    python benchmarks/ep_overlap.py --nproc 2 --out runs/ep-overlap.json

Prints a table (median ms per forward + backward, rank 0) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo


def layer_for(args, rank: int, device: torch.device):
    """One MoE layer, this rank's slice of its experts and the EP exchange, as the trainer sets them."""
    from megatrain.config.model import ModelConfig
    from megatrain.model.moe import MoE
    from megatrain.parallel.dims import ParallelDims, build_process_groups
    from megatrain.parallel.expert_parallel import apply_expert_parallel

    cfg = ModelConfig(vocab_size=128, n_layer=1, n_head=4, d_model=args.d_model, seq_len=args.tokens, mlp="moe",
                      norm="rmsnorm", bias=False, moe={"n_experts": args.experts, "top_k": args.top_k,
                                                      "expert_d_ff": args.expert_ff, "n_shared_experts": args.shared})
    torch.manual_seed(0)
    layer = MoE(cfg, 0).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    groups = build_process_groups(ParallelDims(dp=args.nproc, tp=1, pp=1, ep=args.nproc), rank)
    apply_expert_parallel(layer, groups)
    return layer


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.nproc))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    layer = layer_for(args, rank, device)
    x = torch.randn(1, args.tokens, args.d_model, device=device, requires_grad=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.iters + 2):
        for overlap in (True, False):
            layer.exchange.overlap = overlap
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x).square().mean().backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # warm-up
                times[overlap].append(time.perf_counter() - start)
    if rank == 0:
        on, off = (statistics.median(times[o]) * 1e3 for o in (True, False))
        Path(out).write_text(json.dumps({"on_ms": on, "off_ms": off, "device": torch.cuda.get_device_name() if cuda
                                         else platform.processor() or "cpu", "args": vars(args)}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ff", type=int, default=512)
    parser.add_argument("--shared", type=int, default=2, help="shared experts (width expert-ff each)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="runs/ep-overlap.json")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port, args.out), nprocs=args.nproc)
    result = json.loads(Path(args.out).read_text())
    print(f"one MoE layer, {args.tokens} tokens per rank, d {args.d_model}, top-{args.top_k} of {args.experts} experts "
          f"(width {args.expert_ff}), {args.shared} shared, EP{args.nproc} on {result['device']}")
    print(f"{'shared expert':<28}{'ms fwd+bwd (median)':>22}")
    print(f"{'beside the all-to-all':<28}{result['on_ms']:>22.2f}")
    print(f"{'after it':<28}{result['off_ms']:>22.2f}")
    print(f"overlap saves {100 * (1 - result['on_ms'] / result['off_ms']):.1f}%  JSON: {args.out}")


if __name__ == "__main__":
    main()
