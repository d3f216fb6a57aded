"""Expert parallelism (megatrain/parallel/expert_parallel.py) against one process.

The same file is the rank program: ``torchrun ... test_expert_parallel.py --variants ...`` builds
the model as the trainer does (seeded GPT -> ``parallelize`` (which slices the experts and plugs
in the all-to-all) -> ``deepspeed.initialize`` at ZeRO-0 with LAMB -> ``attach_expert_grad_sync``),
trains a few steps on the global batches every rank draws from one seed and writes the loss and
DeepSpeed's global gradient norm of each step, the gradients of step 1 just before the optimizer
step (after clipping) and every weight after the last step, experts gathered over the EP group.
The reference is the same steps in plain torch in this process: no DeepSpeed, no EP.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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
BASE = {
    "model": dict(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, attention="full",
                  dropout=0.0, position="rope", norm="rmsnorm", mlp="moe", bias=False, block="serial",
                  moe=dict(n_experts=4, top_k=2, n_shared_experts=1, expert_d_ff=32, aux_loss_coef=0.01,
                           z_loss_coef=0.001)),
    "optim": dict(name="lamb", lr=1e-2, min_lr=1e-3, warmup_steps=0, grad_clip=0.5, weight_decay=0.01),
    "train": dict(steps=3, micro_batch_size=2, global_batch_size=8, seed=1234, device="cpu", dtype="fp32"),
    "parallel": dict(zero_stage=0, gpus_per_node=8),
}
TOL = 1e-5


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
    per_rank = cfg.train.global_batch_size // dp
    rows = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    mb = cfg.train.micro_batch_size
    return list(zip(rows[:, :-1].split(mb), rows[:, 1:].split(mb)))


# ---- one rank (under torchrun) ------------------------------------------------------------------


def run_variant(variant: dict, rank: int, world: int, out_dir: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    from megatrain.parallel.deepspeed import DeepSpeedMPU, deepspeed_config
    from megatrain.parallel.dims import ParallelDims, build_process_groups
    from megatrain.parallel.expert_parallel import (
        attach_expert_grad_sync,
        is_expert_param,
    )
    from megatrain.parallel.parallelize import parallelize

    cfg = build_config(variant, world)
    p = cfg.parallel
    dims = ParallelDims(dp=p.data_parallel_size(world), tp=1, pp=1, ep=p.ep)
    dims.validate(world, p.gpus_per_node, cfg.model.n_head, cfg.model.n_layer)
    groups = build_process_groups(dims, rank)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    n_params = sum(q.numel() for q in model.parameters())
    module = parallelize(model, cfg, groups)
    names = {id(q): name for name, q in module.named_parameters()}
    optimizer = build_optimizer(module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, dims.dp, False, n_params),
                                           mpu=DeepSpeedMPU(groups), dist_init_required=False)
    if dims.ep > 1:
        attach_expert_grad_sync(engine.optimizer, engine.module, groups, cfg.optim.grad_clip)
    accumulation = cfg.train.grad_accumulation_steps(dims.dp)
    set_aux_loss_scale(module, 1.0 / accumulation)
    params = [q for q in module.parameters() if q.requires_grad]

    def whole(q: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if not is_expert_param(q):
            return value.detach().clone()
        parts = [torch.empty_like(value) for _ in range(dims.ep)]
        dist.all_gather(parts, value.detach().contiguous(), group=groups.ep_group)
        return torch.cat(parts)

    grads: dict[str, torch.Tensor] = {}

    def capture(opt, args, kwargs) -> None:  # after attach_expert_grad_sync's hook: reduced and clipped
        if not grads:
            grads.update({names[id(q)]: whole(q, q.grad) for q in params})

    engine.optimizer.register_step_pre_hook(capture)
    losses, norms = [], []
    for step in range(cfg.train.steps):
        micro_losses = []
        for inputs, targets in micro_batches(cfg, step, groups.dp_rank, dims.dp):
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.detach())
        end_step(engine.module, groups.dp_group)
        loss = torch.stack(micro_losses).mean()
        dist.all_reduce(loss, group=groups.dp_group)
        losses.append(float(loss) / dims.dp)
        norm = engine.get_global_grad_norm()  # None without EP: DeepSpeed's ZeRO-0 clipping keeps no norm
        norms.append(float("nan") if norm is None else float(norm))
    weights = {names[id(q)]: whole(q, q.data) for q in params}
    local_experts = {names[id(q)]: tuple(q.shape) for q in params if is_expert_param(q)}
    if groups.dp_rank == 0:
        torch.save({"loss": losses, "grad_norm": norms, "grads": grads, "weights": weights, "local": local_experts},
                   out_dir / f"{variant['name']}.pt")
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(nproc: int, variants: list[dict], out_dir: Path) -> dict[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    launch = ForkLaunch(["--out", str(out_dir), "--variants", json.dumps(variants)], nproc, script=str(HERE))
    code, output = run_to_end(launch, env, ROOT, 300)  # forked with torchrun's environment
    if code != 0:
        raise AssertionError(f"the ranks failed ({code}):\n{output[-9000:]}")
    return {v["name"]: torch.load(out_dir / f"{v['name']}.pt", weights_only=True) for v in variants}


def reference_run(variant: dict) -> dict:
    """The same steps in one process, plain torch: micro-batch losses scaled by 1/accumulation,
    clipped by global norm, LAMB, the schedule; the MoE penalties scaled likewise."""
    cfg = build_config({"set": {k: v for k, v in variant.get("set", {}).items() if k != "parallel.ep"}}, world=1)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    named = dict(model.named_parameters())
    losses, norms, grads = [], [], {}
    for step in range(cfg.train.steps):
        micro = micro_batches(cfg, step, dp_rank=0, dp=1)
        set_aux_loss_scale(model, 1.0 / len(micro))
        micro_losses = []
        for inputs, targets in micro:
            loss = model(inputs, targets)
            (loss / len(micro)).backward()
            micro_losses.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        if step == 0:
            grads = {name: q.grad.clone() for name, q in named.items()}
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        end_step(model)
        losses.append(float(torch.stack(micro_losses).mean()))
    return {"loss": losses, "grad_norm": norms, "grads": grads,
            "weights": {name: q.detach().clone() for name, q in named.items()}}


def max_diffs(run: dict, ref: dict) -> dict[str, float]:
    def worst(a: dict, b: dict) -> float:
        assert set(a) == set(b), f"parameters differ: {sorted(set(a) ^ set(b))}"
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    return {"loss": max(abs(x - y) for x, y in zip(run["loss"], ref["loss"])),
            "grad_norm": max(abs(x - y) for x, y in zip(run["grad_norm"], ref["grad_norm"])),
            "grads": worst(run["grads"], ref["grads"]), "weights": worst(run["weights"], ref["weights"])}


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run({})


def check(run: dict, ref: dict, ep: int) -> None:
    diffs = max_diffs(run, ref)
    print("max abs diffs", diffs)
    assert all(value <= TOL for value in diffs.values()), diffs
    assert ref["grad_norm"][0] > BASE["optim"]["grad_clip"], "clipping must be active for the norm to matter"
    assert ref["loss"][0] != ref["loss"][-1]
    # each rank held only its slice of every MoE layer's experts
    assert run["local"] and all(shape[0] == BASE["model"]["moe"]["n_experts"] // ep for shape in run["local"].values())


@pytest.mark.slow
def test_ep2_matches_one_process(tmp_path, reference):
    """With the shared expert computed while the rows travel (the default), after them, and under
    activation checkpointing (whose recompute in the backward exchanges the rows again)."""
    runs = run_ranks(2, [{"name": "ep2", "set": {"parallel.ep": 2}},
                         {"name": "ep2-serial", "set": {"parallel.ep": 2, "parallel.overlap": {"ep_shared_expert": False}}},
                         {"name": "ep2-recompute", "set": {"parallel.ep": 2, "model.activation_checkpointing": True}}],
                     tmp_path)
    check(runs["ep2"], reference, ep=2)
    check(runs["ep2-serial"], reference, ep=2)
    recompute = runs["ep2-recompute"]
    for key in ("grads", "weights", "local"):  # the checkpointed block wraps the block: blocks.0.block.*
        recompute[key] = {name.replace(".block.", "."): value for name, value in recompute[key].items()}
    check(recompute, reference, ep=2)


@pytest.mark.slow
def test_ep2_times_dp2_and_ep4_match_one_process(tmp_path, reference):
    runs = run_ranks(4, [{"name": "ep2dp2", "set": {"parallel.ep": 2}}, {"name": "ep4", "set": {"parallel.ep": 4}}],
                     tmp_path)
    check(runs["ep2dp2"], reference, ep=2)
    check(runs["ep4"], reference, ep=4)


def test_the_comparison_can_fail(reference):
    """A run one LR off the reference is caught by the same comparison."""
    other = reference_run({"set": {"optim.lr": 1.1e-2}})
    assert max(max_diffs(other, reference).values()) > TOL


def test_config_refuses_what_does_not_compose():
    from megatrain.config import ConfigError

    with pytest.raises(Exception, match="parallel.zero_stage"):
        build_config({"set": {"parallel.ep": 2, "parallel.zero_stage": 1}}, world=2)
    with pytest.raises(Exception, match="parallel.tp"):
        build_config({"set": {"parallel.ep": 2, "parallel.tp": 2}}, world=4)
    with pytest.raises(Exception, match="n_experts"):
        build_config({"set": {"parallel.ep": 3}}, world=3)
    with pytest.raises(Exception, match="divide the data-parallel size"):
        build_config({"set": {"parallel.ep": 4}}, world=2)
    assert build_config({"set": {"parallel.ep": 2}}, world=4).parallel.ep == 2
    assert ConfigError  # the loader turns these into a ConfigError naming the field


def test_groups_carve_ep_out_of_dp():
    from megatrain.parallel.dims import ParallelDims

    dims = ParallelDims(dp=4, tp=1, pp=1, ep=2)
    assert dims.ep_groups() == [[0, 1], [2, 3]]
    assert dims.edp_groups() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="must divide dp"):
        ParallelDims(dp=2, tp=1, pp=1, ep=4).validate(2, 8, 4, 2)


def test_plan_divides_the_experts_by_ep():
    from megatrain.config import load_config
    from megatrain.model import expected_parameter_count
    from megatrain.parallel.plan import format_plan, memory_plan, params_per_gpu

    configs = ROOT / "configs"
    layout = ["parallel.zero_stage=0", "train.dtype=fp32"]  # what expert parallelism composes with
    whole = load_config(configs / "moe-olmoe-1b-7b.yaml", layout)
    cfg = load_config(configs / "moe-olmoe-1b-7b.yaml", [*layout, "parallel.ep=8"])
    d, eff, layers, experts = 2048, 1024, 16, 64
    routed = layers * experts * 3 * d * eff
    plan = memory_plan(cfg, world_size=256)
    assert plan.params == expected_parameter_count(cfg.model) - routed + routed // 8
    assert plan.optimizer_bytes == 8 * plan.params  # fp32: m + v of this GPU's parameters (ZeRO-0)
    assert memory_plan(whole, world_size=256).params == expected_parameter_count(whole.model)
    assert params_per_gpu(cfg, tp=1, pp=1) == expected_parameter_count(cfg.model)  # the whole model, as before
    assert "ep=8" in format_plan(plan) and "1/8 of the experts'" in format_plan(plan)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    worker_main()
