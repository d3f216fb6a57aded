"""Context parallelism (megatrain/parallel/context_parallel.py, ring_attention.py) against one process.

The same file is the rank program: under the fork launcher each rank builds the model as the
trainer does (seeded GPT -> ``parallelize`` -> ``deepspeed.initialize`` over the dp x cp replica
group), keeps its two chunks of every sample (``shard_batch``), trains 3 steps with the ring or
the all-to-all attention, and writes the losses, the gradients of step 1 (ZeRO-0: after the
replica reduction) and the final weights. The reference is plain torch in this process on whole
samples. fp32: losses within 1e-6 and gradients within 1e-5, norm-wise relative.

World 2 here (cp=2: ring, all-to-all, ZeRO-1); world 4 in test_context_parallel_4.py.
A rank that keeps its chunks in the wrong order (positions claimed for the other chunk) must
fail the same comparison: that is what shows the comparison sees the chunk placement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megatrain.config import Config
from megatrain.launch.forked import ForkLaunch, run_to_end
from megatrain.model import GPT
from megatrain.model.moe import end_step, set_aux_loss_scale
from megatrain.optim import build_optimizer, build_scheduler

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
EOS = 5
BASE = {
    "model": dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, dropout=0.0, position="rope",
                  norm="rmsnorm", mlp="swiglu", d_ff=48, bias=False, block="serial"),
    "optim": dict(name="lamb", lr=1e-2, min_lr=1e-3, warmup_steps=0, grad_clip=0.5, weight_decay=0.01),
    "train": dict(steps=3, micro_batch_size=2, global_batch_size=4, seed=1234, device="cpu", dtype="fp32"),
    "parallel": dict(zero_stage=0, gpus_per_node=8),
}
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
DOC = {"model.attention_mask": "document"}
# MoE: the balance loss's expert shares are those of the whole samples, which no cp rank holds alone
MOE = {"model.mlp": "moe", "model.moe": dict(n_experts=4, top_k=2, n_shared_experts=1, expert_d_ff=32,
                                             aux_loss_coef=0.01, z_loss_coef=0.001)}
AUX_FREE = {**MOE, "model.moe": {**MOE["model.moe"], "load_balance": "aux_free"}}  # the router's biases move each step


def build_config(variant: dict, world: int) -> Config:
    raw = json.loads(json.dumps(BASE))
    for dotted, value in variant.get("set", {}).items():
        section, key = dotted.split(".", 1)
        raw[section][key] = value
    raw["parallel"]["world_size"] = world
    return Config.model_validate(raw)


def micro_batches(cfg: Config, step: int, dp_rank: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1), generator=gen)
    tokens[tokens % 6 == 0] = EOS  # several documents per sample
    per_rank = cfg.train.global_batch_size // dp
    rows = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    mb = cfg.train.micro_batch_size
    return list(zip(rows[:, :-1].split(mb), rows[:, 1:].split(mb)))


# ---- one rank (under the fork launcher) -------------------------------------------------------------


def run_variant(variant: dict, rank: int, world: int, out_dir: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    from megatrain.model.moe import end_step, set_aux_loss_scale
    from megatrain.parallel.context_parallel import cp_sequence, loss_weight, shard_batch
    from megatrain.parallel.deepspeed import DeepSpeedMPU, attach_lamb_segments, deepspeed_config
    from megatrain.parallel.zero_norms import attach_foreach_norms
    from megatrain.parallel.zero_step import attach_fast_step
    from megatrain.parallel.dims import ParallelDims, build_process_groups
    from megatrain.parallel.expert_parallel import attach_expert_grad_sync, is_expert_param
    from megatrain.parallel.parallelize import parallelize

    cfg = build_config(variant, world)
    p = cfg.parallel
    dims = ParallelDims(dp=p.data_parallel_size(world), tp=p.tp, pp=1, cp=p.cp, ep=p.ep)
    dims.validate(world, p.gpus_per_node, cfg.model.n_head, cfg.model.n_layer)
    groups = build_process_groups(dims, rank)
    replicas = groups.replicas()
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    n_params = sum(q.numel() for q in model.parameters())
    module = parallelize(model, cfg, groups)
    names = {id(q): name for name, q in module.named_parameters()}
    optimizer = build_optimizer(module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, dims.dp, False, n_params),
                                           mpu=DeepSpeedMPU(replicas), dist_init_required=False)
    if cfg.parallel.zero_stage in (1, 2):  # as the trainer: LAMB's norms over the replicas' flat partitions
        attach_foreach_norms(engine.optimizer)
        attach_fast_step(engine.optimizer)
        attach_lamb_segments(engine.optimizer, optimizer, replicas.dp_group, norm_group=replicas.stage_group)
    if dims.ep > 1:  # the experts' gradients over their EDP group, exact clipping (as the trainer)
        attach_expert_grad_sync(engine.optimizer, engine.module, groups, cfg.optim.grad_clip)
    set_aux_loss_scale(module, 1.0 / cfg.train.grad_accumulation_steps(dims.dp))
    params = [q for q in module.parameters() if q.requires_grad]
    grads: dict[str, torch.Tensor] = {}
    replicated = {id(q) for q in params if p.tp == 1 or q.dim() == 1}  # TP shards the matrices (compared by loss)

    def whole(q: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # an expert shard joined over its EP group
        if not is_expert_param(q):
            return value.detach().clone()
        parts = [torch.empty_like(value) for _ in range(dims.ep)]
        dist.all_gather(parts, value.detach().contiguous(), group=groups.ep_group)
        return torch.cat(parts)

    def capture(opt, args, kwargs) -> None:  # ZeRO-0: the reduced, clipped gradients (ZeRO-1 keeps partitions)
        if not grads:
            grads.update({names[id(q)]: whole(q, q.grad) for q in params if id(q) in replicated})

    if cfg.parallel.zero_stage == 0:
        engine.optimizer.register_step_pre_hook(capture)
    document = cfg.model.attention_mask == "document"
    losses = []
    for step in range(cfg.train.steps):
        micro_losses = []
        for inputs, targets in micro_batches(cfg, step, groups.dp_rank, dims.dp):
            x, y, positions, docs = shard_batch(inputs, targets, dims.cp, groups.cp_rank, EOS if document else None)
            if variant.get("swap_chunks"):  # the two chunks' tokens exchanged, their positions kept
                half = x.shape[1] // 2
                x, y = x.roll(half, 1), y.roll(half, 1)
            seq = cp_sequence(positions, docs, p.cp_mode, groups.cp_group, cfg.model.kernels.attention)
            loss = engine(x, y, sequence=seq) * loss_weight(targets, y, dims.cp)
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.detach())
        end_step(engine.module, replicas.dp_group)  # as the trainer: the step's MoE statistics reset
        loss = torch.stack(micro_losses).mean()
        dist.all_reduce(loss, group=replicas.dp_group)
        losses.append(float(loss) / replicas.dims.dp)
    weights = {names[id(q)]: whole(q, q) for q in params if id(q) in replicated}
    if rank == 0:
        torch.save({"loss": losses, "grads": grads, "weights": weights}, out_dir / f"{variant['name']}.pt")
    dist.barrier()


def worker_main() -> None:
    from megatrain.parallel.init import init_distributed, shutdown_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_distributed(device="cpu", backend="gloo", timeout_s=120)
    try:
        for variant in json.loads(args.variants):
            run_variant(variant, env.rank, env.world_size, Path(args.out))
    finally:
        shutdown_distributed()


# ---- the parent: launch, reference, compare -------------------------------------------------------


def run_ranks(nproc: int, variants: list[dict], out_dir: Path) -> dict[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    launch = ForkLaunch(["--out", str(out_dir), "--variants", json.dumps(variants)], nproc, script=str(HERE))
    code, output = run_to_end(launch, env, ROOT, 300)
    if code != 0:
        raise AssertionError(f"the ranks failed ({code}):\n{output[-9000:]}")
    return {v["name"]: torch.load(out_dir / f"{v['name']}.pt", weights_only=True) for v in variants}


def reference_run(settings: dict) -> dict:
    """The same steps in one process on whole samples: no DeepSpeed, no cp."""
    plain = {k: v for k, v in settings.items() if not k.startswith("parallel.")}
    cfg = build_config({"set": plain}, world=1)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    model.eos_id = EOS
    set_aux_loss_scale(model, 1.0 / cfg.train.grad_accumulation_steps(1))  # MoE penalties: as the loss
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    named = dict(model.named_parameters())
    losses, grads = [], {}
    for step in range(cfg.train.steps):
        micro = micro_batches(cfg, step, dp_rank=0, dp=1)
        micro_losses = []
        for inputs, targets in micro:
            loss = model(inputs, targets)
            (loss / len(micro)).backward()
            micro_losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        if step == 0:
            grads = {name: q.grad.clone() for name, q in named.items()}
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        end_step(model)  # as the trainer: the aux-free biases move, the step's MoE statistics reset
        losses.append(float(torch.stack(micro_losses).mean()))
    return {"loss": losses, "grads": grads, "weights": {name: q.detach().clone() for name, q in named.items()}}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def errors(run: dict, ref: dict) -> dict[str, float]:
    loss = max(abs(x - y) / abs(y) for x, y in zip(run["loss"], ref["loss"]))
    grads = max((relative(g, ref["grads"][n]) for n, g in run["grads"].items()), default=0.0)
    weights = max(relative(w, ref["weights"][n]) for n, w in run["weights"].items())
    return {"loss": loss, "grads": grads, "weights": weights}


def check(run: dict, ref: dict, zero_stage: int = 0) -> None:
    e = errors(run, ref)
    print("relative errors", e)
    assert e["loss"] <= LOSS_TOL and e["grads"] <= GRAD_TOL and e["weights"] <= GRAD_TOL, e
    if zero_stage == 0:
        assert run["grads"], "no gradients captured"


@pytest.fixture(scope="module")
def references() -> dict:
    return {"causal": reference_run({}), "document": reference_run(DOC)}


def test_cp2_ring_alltoall_zero1_match_one_process(tmp_path, references):
    ring, a2a = {"parallel.cp": 2}, {"parallel.cp": 2, "parallel.cp_mode": "alltoall"}
    variants = [
        {"name": "ring", "set": ring}, {"name": "ring-doc", "set": {**ring, **DOC}},
        {"name": "a2a", "set": a2a}, {"name": "a2a-doc", "set": {**a2a, **DOC}},
        {"name": "ring-doc-zero1", "set": {**ring, **DOC, "parallel.zero_stage": 1}},
        {"name": "ring-swapped", "set": ring, "swap_chunks": True},
        {"name": "ring-moe", "set": {**ring, **MOE}},
        {"name": "ring-moe-ep2", "set": {**ring, **MOE, "parallel.ep": 2}},  # the experts over the cp ranks
        {"name": "a2a-moe-ep2-aux-free", "set": {**a2a, **AUX_FREE, "parallel.ep": 2}},  # biases from whole samples
    ]
    runs = run_ranks(2, variants, tmp_path)
    for name, ref in (("ring", "causal"), ("ring-doc", "document"), ("a2a", "causal"), ("a2a-doc", "document")):
        check(runs[name], references[ref])
    check(runs["ring-doc-zero1"], references["document"], zero_stage=1)
    moe = reference_run(MOE)
    check(runs["ring-moe"], moe)
    check(runs["ring-moe-ep2"], moe)
    check(runs["a2a-moe-ep2-aux-free"], reference_run(AUX_FREE))
    assert not runs["ring-doc-zero1"]["grads"] and runs["ring-doc-zero1"]["weights"]
    swapped = errors(runs["ring-swapped"], references["causal"])  # a misplaced chunk is seen
    assert swapped["loss"] > 100 * LOSS_TOL and swapped["grads"] > 1e-2, swapped


def test_config_refuses_heads_not_divisible_by_cp():
    with pytest.raises(Exception, match="model.n_kv_head"):
        build_config({"set": {"parallel.cp": 4, "parallel.cp_mode": "alltoall"}}, world=4)
    with pytest.raises(Exception, match="parallel.cp"):
        build_config({"set": {"parallel.cp": 3}}, world=3)  # 16 tokens do not cut into 6 chunks
    assert build_config({"set": {"parallel.cp": 4}}, world=4).parallel.cp == 4  # the ring takes any head count


def test_layout_orders_tp_cp_dp():
    from megatrain.parallel.dims import ParallelDims

    dims = ParallelDims(dp=2, tp=2, pp=1, cp=2)
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]] == dims.replicas().dp_groups()
    for rank in range(8):  # the replica index is the dp coordinate of the replica layout
        pp, dp, tp = dims.coords(rank)
        assert dims.replicas().coords(rank) == (pp, dp * 2 + dims.cp_rank(rank), tp)


def test_chunks_balance_the_causal_work():
    from megatrain.parallel.context_parallel import chunk_positions

    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([chunk_positions(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    work = [int((chunk_positions(16, 4, r) + 1).sum()) for r in range(4)]  # keys each rank's queries see
    assert len(set(work)) == 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    worker_main()


def test_cp_composes_with_the_pipeline_and_expert_parallelism():
    """cp x pp is a layout (test_parity.py's pp2xcp2 variants match one process); so is cp x ep, with
    the EP groups carved out of the dp x cp replicas (an ep that does not divide them is refused
    naming the field); the document mask with a pipeline is a layout too (test_parity.py's document variants)."""
    from megatrain.config import ConfigError
    from megatrain.parallel.dims import ParallelDims

    assert build_config({"set": {"parallel.cp": 2, "parallel.pp": 2}}, 4).parallel.pp == 2
    moe = {"model.mlp": "moe", "parallel.cp": 2, "parallel.ep": 2}
    assert build_config({"set": moe}, 2).parallel.ep == 2  # dp 1: the experts spread over a sample's cp ranks
    with pytest.raises((ValueError, ConfigError), match=r"parallel.ep \(4\) must divide"):
        build_config({"set": {**moe, "parallel.ep": 4}}, 2)
    assert build_config({"set": {"parallel.cp": 2, "parallel.pp": 2, **DOC}}, 4).model.attention_mask == "document"
    dims = ParallelDims(dp=2, tp=1, pp=1, cp=2, ep=2)  # replica index = dp_rank * cp + cp_rank = rank here
    assert dims.ep_groups() == [[0, 1], [2, 3]] and dims.edp_groups() == [[0, 2], [1, 3]]
    assert ParallelDims(dp=2, tp=1, pp=1, cp=2, ep=4).edp_groups() == [[0], [1], [2], [3]]
