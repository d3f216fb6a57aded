"""Tensor parallelism on GPUs (NCCL): a correctness check against the unsharded model, then the
time of a forward + backward pass at each overlap setting. Not a test (needs >= 2 GPUs):

    torchrun --nproc-per-node 2 tests/megatrain/parallel/bench_tp_overlap.py [--out results.json]

Correctness runs in fp32 (TF32 off) with small shapes; timing in bf16 with a GPT-1.3B layer
shape (d 2048, 16 heads, seq 2048). Rank 0 prints a table; times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatrain.config import ModelConfig, OverlapConfig
from megatrain.model import GPT
from megatrain.parallel.dims import ParallelDims, build_process_groups
from megatrain.parallel.tensor_parallel import apply_tensor_parallel, full_tensor


def tp_model(cfg: ModelConfig, groups, sp: bool, chunks: int, dtype: torch.dtype, device: torch.device) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    apply_tensor_parallel(model, groups, sequence_parallel=sp, overlap=OverlapConfig(tp_chunks=chunks))
    return model.to(dtype)


def batch(cfg: ModelConfig, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def check(groups, block: str, sp: bool, chunks: int, device: torch.device) -> dict:
    cfg = ModelConfig(vocab_size=512, n_layer=2, n_head=8, d_model=256, seq_len=256, block=block, attention="full")
    idx, tgt = batch(cfg, 4, device)
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    ref_loss = ref(idx, tgt)
    ref_loss.backward()
    model = tp_model(cfg, groups, sp, chunks, torch.float32, device)
    loss = model(idx, tgt)
    loss.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        grad = full_tensor(param, groups.tp_group, param.grad)
        want = ref_params[name].grad
        worst = max(worst, float((grad - want).norm() / want.norm().clamp_min(1e-30)))
    return {"block": block, "sp": sp, "chunks": chunks, "loss_rel_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "grad_rel_err_max": worst}


def time_setting(groups, block: str, sp: bool, chunks: int, device: torch.device, iters: int = 20, warmup: int = 5) -> dict:
    cfg = ModelConfig(vocab_size=50304, n_layer=4, n_head=16, d_model=2048, seq_len=2048, block=block, attention="full")
    idx, tgt = batch(cfg, 4, device)
    model = tp_model(cfg, groups, sp, chunks, torch.bfloat16, device)

    def step() -> None:
        model(idx, tgt).backward()
        for param in model.parameters():
            param.grad = None

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    del model
    torch.cuda.empty_cache()
    return {"block": block, "sp": sp, "chunks": chunks, "ms": ms.item(), "tokens_per_s": 4 * cfg.seq_len / ms.item() * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--check-only", action="store_true", help="skip timing (e.g. on CPU with gloo)")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = build_process_groups(ParallelDims(dp=1, tp=world, pp=1), rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    checks = [check(groups, b, sp, c, device) for b, sp, c in
              [("parallel", True, 1), ("parallel", True, 2), ("serial", True, 2), ("serial", True, 4), ("parallel", False, 1)]]
    times = [] if args.check_only else [
        time_setting(groups, b, sp, c, device) for b in ("parallel", "serial") for sp, c in [(False, 1), (True, 1), (True, 2), (True, 4)]
    ]
    if rank == 0:
        print(f"tp={world}, CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}")
        for c in checks:
            print(f"check {c['block']:8s} sp={c['sp']!s:5s} chunks={c['chunks']}: loss rel err {c['loss_rel_err']:.1e}, "
                  f"max grad rel err {c['grad_rel_err_max']:.1e}")
        for t in times:
            print(f"time  {t['block']:8s} sp={t['sp']!s:5s} chunks={t['chunks']}: {t['ms']:8.2f} ms/iter "
                  f"{t['tokens_per_s']:10.0f} tokens/s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "checks": checks, "times": times,
                           "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
