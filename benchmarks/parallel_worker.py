"""One torchrun rank of ``benchmarks/parallel.py`` (``--worker``): runs its configurations one after
another in one torch.distributed world and writes ``rank<N>.json`` per configuration.

What a rank measures: ``Trainer.train`` runs unchanged, except that (1) ``train_step`` is
wrapped so that after each step the rank synchronises the GPU and reads a host clock (the
trainer's own ``step_time_s`` is read before its ``loss.item()``; on two H200s it gave 0-1.5%
more tokens/s than this clock), (2) the checkpointer's save is switched off (the recipe saves at the last step),
(3) the GPT is built directly on the GPU (``with torch.device(...)``) instead of on the CPU
and moved: 1.3B parameters take ~25 s to initialise on 2 CPU cores. Every configuration is built
the same way, so seeds still give every run the same initial weights. (4) Right after the
Trainer is built, ``megatrain.parallel.overlap.attach_dp_overlap(trainer.engine, cfg, groups)``
is called, which the committed trainer does not do: ZeRO-0 data parallelism then all-reduces
gradient buckets during the backward pass instead of after it. It does nothing for dp=1,
ZeRO >= 1, pipelines or ``parallel.overlap.dp_overlap_comm=false``, so ``dp2-nooverlap`` is the
trainer as committed (and, measured, the faster one on NVLink: see overlap.py).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import time
from pathlib import Path

from parallel_configs import SAFE_ENV, TP_ENV


def _timed_trainer(trainer, records: list[dict], sync) -> None:
    """Wrap ``trainer.train_step``: after each step, synchronise and read the clock."""
    step_fn = trainer.train_step
    last = [time.perf_counter()]

    def timed():
        metrics = step_fn()
        sync()
        now = time.perf_counter()
        records.append({
            "step": metrics.step, "loss": metrics.loss, "grad_norm": metrics.grad_norm, "wall_s": now - last[0],
            "trainer_step_time_s": metrics.step_time_s, "trainer_tokens_per_s": metrics.tokens_per_s,
            "trainer_mfu": metrics.mfu, "phases_ms": metrics.phases_ms,
        })
        last[0] = now
        return metrics

    trainer.train_step = timed
    trainer._bench_reset_clock = lambda: last.__setitem__(0, time.perf_counter())


def _run_variant(variant: dict, env, args, log) -> None:
    import torch

    import megatrain.training.trainer as trainer_module
    from megatrain.config import load_config
    from megatrain.model import GPT
    from megatrain.parallel.overlap import attach_dp_overlap

    name = variant["name"]
    run_dir = Path(args.work_dir) / name
    overrides = [
        *variant["overrides"], f"train.run_dir={run_dir}", f"checkpoint.staging_dir={run_dir}/staging",
        f"checkpoint.durable_url={run_dir}/checkpoints", "checkpoint.interval=1000000000", "train.log_interval=1",
    ]
    cfg = load_config(args.config, overrides)
    cuda = env.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(env.device)) if cuda else (lambda: None)

    def gpt_on_device(model_cfg):  # see the module docstring, (3)
        with torch.device(env.device):
            return GPT(model_cfg)

    trainer_module.GPT = gpt_on_device
    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    started = time.perf_counter()
    trainer = trainer_module.Trainer(cfg, env)
    trainer.checkpointer.maybe_save = lambda _trainer: False  # see the module docstring, (2)
    reducer = attach_dp_overlap(trainer.engine, cfg, trainer.groups,  # see the module docstring, (4)
                                max_ctas=variant.get("dp_max_ctas"))
    build_s = time.perf_counter() - started
    records: list[dict] = []
    _timed_trainer(trainer, records, sync)
    sync()
    trainer._bench_reset_clock()
    result = trainer.train()
    out = {
        "name": name, "rank": env.rank, "world_size": env.world_size, "overrides": overrides,
        "layout": {"dp": trainer.groups.dims.dp, "tp": trainer.groups.dims.tp, "pp": trainer.groups.dims.pp},
        "coords": {"pp": trainer.groups.pp_rank, "dp": trainer.groups.dp_rank, "tp": trainer.groups.tp_rank},
        "grad_accumulation": trainer.grad_accumulation, "tokens_per_step": trainer.tokens_per_step,
        "flops_per_token": trainer.flops_per_token, "n_params": trainer.n_params,
        "peak_flops_per_gpu": (trainer.peak_flops / env.world_size) if trainer.peak_flops else None,
        "dp_overlap_attached": reducer is not None, "build_s": build_s, "train_wall_s": result.wall_s, "status": result.status, "steps": records,
        "device": torch.cuda.get_device_name(env.device) if cuda else platform.processor() or "cpu",
        "env": {k: os.environ.get(k) for k in (*SAFE_ENV, *TP_ENV)},
    }
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(env.device) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(env.device) / 2**30
    (run_dir / f"rank{env.rank}.json").write_text(json.dumps(out, indent=1))
    log.info("%s: %d steps, final loss %.4f, build %.1f s, train %.1f s", name, result.steps, result.final_loss,
             build_s, result.wall_s)
    # Free this configuration before the next one in the same process. Dynamo's compiled code stays:
    # parameters are graph inputs, so the next model of the same structure reuses it.
    if reducer is not None:
        reducer.remove()
    reducer = None  # it holds the engine (is_boundary): keep nothing alive into the next configuration
    engine = trainer.engine
    try:
        if hasattr(engine, "destroy"):
            engine.destroy()
    except Exception as exc:  # freeing is best effort
        log.warning("engine.destroy() failed: %s", exc)
    del trainer, engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        log.info("after cleanup: %.2f GiB still allocated", torch.cuda.memory_allocated(env.device) / 2**30)


def worker(args) -> int:
    from megatrain.config import load_config
    from megatrain.parallel.init import init_distributed, shutdown_distributed
    from megatrain.training.rank import setup_logging

    variants = json.loads(args.variants)
    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank)
    log = logging.getLogger("megatrain")
    first = load_config(args.config, variants[0]["overrides"])
    env = init_distributed(first.train.device, first.parallel.backend, first.reliability.collective_timeout_s)
    failed = 0
    try:
        for variant in variants:
            try:
                _run_variant(variant, env, args, log)
            except Exception as exc:  # recorded; the next configuration still runs if the group survived
                import traceback

                failed += 1
                log.error("%s failed on rank %d: %s", variant["name"], env.rank, exc)
                run_dir = Path(args.work_dir) / variant["name"]
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / f"error-rank{env.rank}.txt").write_text(traceback.format_exc())
                traceback.print_exc()
    finally:
        shutdown_distributed()
    return 1 if failed else 0
