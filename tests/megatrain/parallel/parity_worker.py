"""One rank of a parity run (started by torchrun from conftest.run_parity).

For each requested variant it builds the model exactly as the trainer does (seeded GPT ->
``parallelize`` -> ``deepspeed.initialize`` with LAMB, ZeRO-1 and gradient clipping), trains a
few steps on random token batches that every rank generates from the same seed, and writes
what the parent compares with the single-process run of the same global batch:

- ``loss``: the global-batch loss of each step;
- ``grad_norm``: DeepSpeed's global gradient norm of each step (before clipping);
- ``grads``: the whole (DP-reduced, TP-gathered) gradient of a few parameters at step 1, taken
  just before the optimizer step;
- ``weights``: every parameter of this rank's stage after the last step, TP-gathered.

Under a pipeline each rank feeds its stages what the trainer feeds them
(``pipeline.stage_micro_batch``): under context parallelism its two chunks of every micro-batch
(the replica group dp x cp is what DeepSpeed reduces over), under the document mask (tokens,
document ids). The document variants' batches have an EOS (token 0) at about one token in eight,
so each 16-token sample holds a few documents.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from megatrain.config import Config
from megatrain.model import GPT, count_parameters
from megatrain.optim import Lamb, build_optimizer, build_scheduler
from megatrain.parallel.deepspeed import DeepSpeedMPU, attach_lamb_segments, deepspeed_config
from megatrain.parallel.dims import ParallelDims, build_process_groups
from megatrain.parallel.init import init_distributed, shutdown_distributed
from megatrain.parallel.overlap import attach_dp_overlap
from megatrain.parallel.parallelize import parallelize
from megatrain.parallel.pipeline import stage_micro_batch
from megatrain.parallel.tensor_parallel import full_tensor
from megatrain.parallel.zero_norms import attach_foreach_norms

# Small enough for 2 CPU cores, big enough that every split is real (heads, ffn, vocab, seq).
BASE = {
    "model": dict(vocab_size=128, n_layer=2, n_head=4, d_model=32, seq_len=16, attention="full", dropout=0.0),
    "optim": dict(name="lamb", lr=1e-2, min_lr=1e-3, warmup_steps=0, grad_clip=0.5, weight_decay=0.01),
    "train": dict(steps=3, micro_batch_size=2, global_batch_size=8, seed=1234, device="cpu", dtype="fp32"),
    "parallel": dict(zero_stage=1, gpus_per_node=8),
}
SAMPLED = ("embed.wte.weight", "embed.wpe.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
           "blocks.0.attn.proj.bias", "blocks.0.mlp.fc.bias", "blocks.0.mlp.proj.weight", "head.ln_f.weight")


def build_config(variant: dict, world: int) -> Config:
    raw = {section: dict(values) for section, values in BASE.items()}
    for dotted, value in variant.get("set", {}).items():
        section, key = dotted.split(".", 1)
        if "." in key:  # parallel.overlap.tp_chunks
            sub, leaf = key.split(".")
            raw.setdefault(section, {}).setdefault(sub, {})[leaf] = value
        else:
            raw.setdefault(section, {})[key] = value
    raw["parallel"]["world_size"] = world
    return Config.model_validate(raw)


EOS = 0  # the document variants' end-of-document token


def build_model(cfg: Config) -> GPT:
    """The seeded GPT every rank and the reference build (its EOS id for the document mask)."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    model.eos_id = EOS
    return model


def global_batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1), generator=gen)
    if cfg.model.attention_mask == "document":  # documents of a few tokens each
        tokens[tokens < cfg.model.vocab_size // 8] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def my_micro_batches(cfg: Config, step: int, dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, targets = global_batch(cfg, step)
    per_rank = cfg.train.global_batch_size // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    mb = cfg.train.micro_batch_size
    return list(zip(inputs[rows].split(mb), targets[rows].split(mb)))


def compare_norms(zero) -> dict[str, float | bool]:
    """megatrain's multi-tensor norm and inf/NaN check (parallel/zero_norms.py) beside DeepSpeed's own
    on this step's gradients, then with a NaN, an inf and a huge finite value (1e30: its square
    overflows the fp32 total, not the fp64 sums) planted in the first one (put back after)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    def norms() -> tuple[float, float]:
        ours = sum(float(zero.get_grad_norm_direct(zero.averaged_gradients[i], zero.params_in_partition[i])) ** 2
                   for i in range(len(zero.bit16_groups)))
        theirs = sum(float(Zero.get_grad_norm_direct(zero, zero.averaged_gradients[i], zero.params_in_partition[i])) ** 2
                     for i in range(len(zero.bit16_groups)))
        return ours ** 0.5, theirs ** 0.5

    out: dict[str, float | bool] = {}
    out["ours"], out["theirs"] = norms()
    first = next(g for g in zero.averaged_gradients[0] if g is not None and g.numel())
    kept = first.view(-1)[0].item()
    for name, value in (("clean", kept), ("nan", float("nan")), ("inf", float("inf")), ("huge", 1e30)):
        first.view(-1)[0] = value
        out[f"overflow_{name}_ours"] = bool(zero.has_overflow_partitioned_grads_serial())
        out[f"overflow_{name}_theirs"] = bool(Zero.has_overflow_partitioned_grads_serial(zero))
        if name != "clean":
            out[f"norm_{name}_ours"] = float(zero.get_grad_norm_direct(zero.averaged_gradients[0], zero.params_in_partition[0]))
            out[f"norm_{name}_theirs"] = float(Zero.get_grad_norm_direct(zero, zero.averaged_gradients[0],
                                                                          zero.params_in_partition[0]))
    first.view(-1)[0] = kept
    return out


def run_variant(variant: dict, rank: int, world: int, out_dir: Path) -> None:
    cfg = build_config(variant, world)
    p = cfg.parallel
    dims = ParallelDims(dp=p.data_parallel_size(world), tp=p.tp, pp=p.pp, cp=p.cp)
    dims.validate(world, p.gpus_per_node, cfg.model.n_head, cfg.model.n_layer)
    all_groups = build_process_groups(dims, rank)
    groups = all_groups.replicas()  # dp x cp replicas, as ZeRO and the reduction see them (itself at cp 1)

    model = build_model(cfg)
    n_params = count_parameters(model)
    module = parallelize(model, cfg, all_groups)
    # GPT's own names, also under a pipeline; CheckpointedBlock wraps a block as blocks.i.block
    names = {id(param): name.replace(".block.", ".") for name, param in model.named_parameters()}
    optimizer = build_optimizer(module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, dims.dp, False, n_params),
        mpu=None if dims.pp > 1 else DeepSpeedMPU(groups), dist_init_required=False,
    )
    if isinstance(optimizer, Lamb) and p.zero_stage in (1, 2):  # as the trainer does
        attach_lamb_segments(engine.optimizer, optimizer, groups.dp_group, norm_group=groups.stage_group)
    foreach_norms = attach_foreach_norms(engine.optimizer)  # as the trainer does (ZeRO-1/2)
    # ZeRO-0's all-reduce overlapped with backward (None elsewhere): the call a trainer makes to use
    # it (the committed trainer does not: slower on NVLink, see megatrain/parallel/overlap.py)
    reducer = attach_dp_overlap(engine, cfg, groups)
    if variant.get("expect_dp_overlap") is not None:
        assert (reducer is not None) == variant["expect_dp_overlap"], "attach_dp_overlap applied where it should not"
    params = [q for q in engine.module.parameters() if q.requires_grad]
    if dims.pp > 1:  # the other stages' layers were built too, and must have been released
        local = {id(q) for q in engine.module.parameters()}
        assert all(q.is_meta for q in model.parameters() if id(q) not in local), "other stages' weights kept"

    grads: dict[str, torch.Tensor] = {}
    norm_check: dict[str, float | bool] = {}
    zero_step = engine.optimizer.step

    def capture_then_step(*args, **kwargs):  # runs after the DP reduction, before clipping and the update
        if foreach_norms and not norm_check:
            norm_check.update(compare_norms(engine.optimizer))
        if not grads:
            for param in params:
                if names[id(param)] in SAMPLED:
                    grads[names[id(param)]] = full_tensor(param, groups.tp_group, safe_get_full_grad(param)).clone()
        return zero_step(*args, **kwargs)

    engine.optimizer.step = capture_then_step
    fp32_norms: list[float] = []
    if p.zero_stage == 0:  # fp32 ZeRO-0: DeepSpeed clips the model's gradients itself and keeps no norm
        clip = engine.clip_fp32_gradients

        def capture_then_clip():
            full = [full_tensor(q, groups.tp_group, q.grad) for q in params if q.grad is not None]
            fp32_norms.append(float(torch.stack([g.norm() for g in full]).norm()))
            if not grads:
                for param in params:
                    if names[id(param)] in SAMPLED:
                        grads[names[id(param)]] = full_tensor(param, groups.tp_group, param.grad).clone()
            return clip()

        engine.clip_fp32_gradients = capture_then_clip
    losses, norms = [], []
    for step in range(cfg.train.steps):
        micro = my_micro_batches(cfg, step, all_groups.dp_rank, dims.dp)
        if dims.pp > 1:
            micro = [stage_micro_batch(x, y, cfg, all_groups, EOS) for x, y in micro]
            if variant.get("swap_chunks"):  # the two chunks' tokens exchanged, their positions kept: must not match
                micro = [(x.roll(x.shape[1] // 2, 1), y.roll(y.shape[1] // 2, 1)) for x, y in micro]
            if variant.get("drop_doc_ids"):  # one document per sample: must not match the document mask
                micro = [((x, torch.zeros_like(docs)), y) for (x, docs), y in micro]
            loss = engine.train_batch(iter(micro))  # 1F1B over the micro-batches, DP-averaged
        else:
            micro_losses = []
            for inputs, targets in micro:
                micro_loss = engine(inputs, targets)
                engine.backward(micro_loss)
                engine.step()
                micro_losses.append(micro_loss.detach())
            loss = torch.stack(micro_losses).mean()
            if dims.dp > 1:
                dist.all_reduce(loss, group=groups.dp_group)
                loss /= dims.dp
        losses.append(float(loss))
        norms.append(fp32_norms[-1] if p.zero_stage == 0 else float(engine.get_global_grad_norm()))

    def whole(q: torch.nn.Parameter) -> torch.Tensor:  # ZeRO-3 keeps only a partition in q
        return full_tensor(q, groups.tp_group, safe_get_full_fp32_param(q) if hasattr(q, "ds_id") else None)

    if reducer is not None:
        reducer.remove()
    weights = {names[id(q)]: whole(q).clone() for q in params}
    if all_groups.dp_rank == 0 and all_groups.tp_rank == 0 and all_groups.cp_rank == 0:
        result = {"loss": losses, "grad_norm": norms, "grads": grads, "weights": weights, "stage": groups.pp_rank,
                  "norm_check": norm_check}
        torch.save(result, out_dir / f"{variant['name']}.stage{groups.pp_rank}.pt")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", required=True, help="JSON list of {name, set: {dotted: value}}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_distributed(device="cpu", backend="gloo", timeout_s=120)
    try:
        for variant in json.loads(args.variants):
            run_variant(variant, env.rank, env.world_size, Path(args.out))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
