"""One process (gloo) for test_zero_step.py: a small bf16 Llama-style GPT trained by DeepSpeed's
ZeRO-1 with a fused AdamW and active clipping, twice from one seed: with megatrain's step
(parallel/zero_step.py; on CPU its AdamW pass is the torch reference of kernels/adamw_master.py)
and with DeepSpeed's own; then resumes from a checkpoint of megatrain's kind (checkpoint/state.py)
saved under one step and resumed under the other. Writes what the test compares.

    python zero_step_worker.py OUT.pt [cuda]   (under torchrun for several ranks)
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch

from megatrain.checkpoint import state as ckstate
from megatrain.config import Config
from megatrain.model import GPT, count_parameters
from megatrain.optim import build_scheduler, param_groups
from megatrain.parallel.deepspeed import DeepSpeedMPU, deepspeed_config
from megatrain.parallel.dims import ParallelDims, build_process_groups
from megatrain.parallel.init import init_distributed, shutdown_distributed
from megatrain.parallel.zero_norms import attach_foreach_norms
from megatrain.parallel.zero_step import _master_step, attach_fast_step

CONFIG = {
    "model": dict(vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, attention="full",
                  position="rope", norm="rmsnorm", mlp="swiglu", bias=False, dropout=0.0),
    # grad_clip far under the gradients' norm: every step is clipped
    "optim": dict(name="adamw", lr=1e-2, min_lr=1e-3, warmup_steps=0, grad_clip=0.05, weight_decay=0.1),
    "train": dict(steps=3, micro_batch_size=2, global_batch_size=8, seed=7, device="cpu", dtype="bf16"),
    "parallel": dict(zero_stage=1),
}


def build(fast: bool, world: int, rank: int, device: torch.device, seed: int | None = None):
    """(config, engine, model, inner optimizer) from the seed, with megatrain's step when ``fast``."""
    cfg = Config.model_validate({**CONFIG, "parallel": {**CONFIG["parallel"], "world_size": world},
                                 "train": {**CONFIG["train"], "device": device.type}})
    groups = build_process_groups(ParallelDims(dp=world, tp=1, pp=1), rank)
    torch.manual_seed(cfg.train.seed if seed is None else seed)
    model = GPT(cfg.model).to(device, torch.bfloat16)
    # the fused AdamW that build_optimizer picks on a GPU (on CPU it picks foreach)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=cfg.optim.betas, eps=cfg.optim.eps, fused=True)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, cfg.optim, 10),
        config=deepspeed_config(cfg, world, True, count_parameters(model)), mpu=DeepSpeedMPU(groups),
        dist_init_required=False)
    attach_foreach_norms(engine.optimizer)
    attached = attach_fast_step(engine.optimizer) if fast else False
    return cfg, engine, model, optimizer, attached


def train(fast: bool, world: int, rank: int, device: torch.device) -> dict:
    cfg, engine, model, optimizer, attached = build(fast, world, rank, device)
    zero = engine.optimizer
    norms, first = [], {}
    gen = torch.Generator().manual_seed(99)
    per_rank = cfg.train.global_batch_size // world
    for step in range(cfg.train.steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1), generator=gen)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        for micro in mine.split(cfg.train.micro_batch_size):
            micro = micro.to(device)
            engine.backward(engine(micro[:, :-1], micro[:, 1:]))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        if step == 0:  # after one step both runs have seen the same gradients
            first = state_of(zero, optimizer, model)
    last = state_of(zero, optimizer, model)
    # a step whose gradients are NaN (a fault no batch should cause): skipped, nothing moves; the next trains
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1), generator=gen)
    for micro in tokens[rank * per_rank:(rank + 1) * per_rank].split(cfg.train.micro_batch_size):
        micro = micro.to(device)
        engine.backward(engine(micro[:, :-1], micro[:, 1:]) * float("nan"))
        engine.step()
    skipped = {"norm": float(engine.get_global_grad_norm()), **state_of(zero, optimizer, model)}
    for micro in tokens[rank * per_rank:(rank + 1) * per_rank].split(cfg.train.micro_batch_size):
        micro = micro.to(device)
        engine.backward(engine(micro[:, :-1], micro[:, 1:]))
        engine.step()
    after = {"norm": float(engine.get_global_grad_norm()), **state_of(zero, optimizer, model)}
    return {"attached": attached, "own_step": getattr(zero.step, "__func__", None) is _master_step, "norms": norms,
            "skipped": skipped, "after": after,
            "kept_in_place": "reduce_ready_partitions_and_remove_grads" in vars(zero),
            "first": first, "last": last}


def state_of(zero, optimizer, model) -> dict:
    states = [optimizer.state[p] for p in zero.single_partition_of_fp32_groups]
    return {"masters": torch.cat([p.detach().float().cpu() for p in zero.single_partition_of_fp32_groups]),
            "weights": torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]),
            "exp_avg": torch.cat([s["exp_avg"].cpu() for s in states]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].cpu() for s in states]),
            "steps": [float(s["step"]) for s in states]}


def resume(world: int, rank: int, device: torch.device) -> dict:
    """Two steps, a checkpoint of megatrain's kind (checkpoint/state.py), two more; against a fresh
    engine that loads the checkpoint and takes the same two steps. For each pair of (saving step,
    resuming step): the largest difference of the final bf16 weights."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CONFIG["model"]["vocab_size"], (8, CONFIG["model"]["seq_len"] + 1), generator=gen)
               for _ in range(4)]

    def steps(engine, chunk):
        for batch in chunk:
            for micro in batch.to(device).split(CONFIG["train"]["micro_batch_size"]):
                engine.backward(engine(micro[:, :-1], micro[:, 1:]))
                engine.step()

    out = {}
    for saved_by, resumed_by in (("deepspeed", "megatrain"), ("megatrain", "deepspeed"), ("megatrain", "megatrain")):
        _, first, first_model, _, _ = build(saved_by == "megatrain", world, rank, device)
        steps(first, batches[:2])
        tensors, meta = ckstate.optimizer_state(first.optimizer)
        tensors = {k: v.clone() for k, v in tensors.items()}
        weights = {k: v.clone() for k, v in first_model.state_dict().items()}
        schedule = first.lr_scheduler.state_dict()
        steps(first, batches[2:])
        _, second, second_model, _, _ = build(resumed_by == "megatrain", world, rank, device, seed=99)
        second_model.load_state_dict(weights)
        ckstate.load_optimizer_state(second.optimizer, tensors, meta)
        second.lr_scheduler.load_state_dict(schedule)
        steps(second, batches[2:])
        out[f"{saved_by}->{resumed_by}"] = max(float((a.float() - b.float()).abs().max())
                                               for a, b in zip(first_model.parameters(), second_model.parameters()))
    return out


def main() -> None:
    out, device = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "cpu")
    env = init_distributed(device=device, timeout_s=120)
    try:
        result = {"fast": train(True, env.world_size, env.rank, env.device),
                  "deepspeed": train(False, env.world_size, env.rank, env.device),
                  "resume": resume(env.world_size, env.rank, env.device)}
        torch.save(result, f"{out}.rank{env.rank}")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
