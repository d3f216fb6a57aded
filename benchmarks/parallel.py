"""Multi-GPU scaling of the real trainer: data, tensor and pipeline parallelism, each overlap on/off.

    python3 benchmarks/parallel.py --out results.json [--quick] [--only dp1,dp2,...] [--label COMMIT]
        [--tp-overlap-check] [--schedule 'tp2-sp-c2+tp2-sp-c1;dp1|dp1-gb32;dp2+dp2-nooverlap']
    python3 benchmarks/parallel.py --quick --schedule 4 --out results.json   # four GPUs: DP4 + 13B layouts
    python3 benchmarks/parallel.py --quick --schedule 8 --out results.json   # eight: DP8 + 13B TPxPPxDP
    python3 benchmarks/parallel.py --cpu --quick --out cpu.json  # the same on 2 CPU processes (gloo)
    python3 benchmarks/parallel.py --cpu --quick --schedule 4 --out cpu4.json  # 4 CPU processes, tiny "13B"

Every configuration is the real ``megatrain.trainer.Trainer`` on ``configs/gpt-1.3b.yaml`` (with
the overrides listed in ``CONFIGS``) on real data, launched with torchrun::

    python3 -m torch.distributed.run --nproc-per-node N benchmarks/parallel.py --worker \
        --config configs/gpt-1.3b.yaml --work-dir W --variants '[{"name": ..., "overrides": [...]}]'

Before the first launch the shards are built once (``shard_command``; with ``--tp-overlap-check``
tests/megatrain/parallel/bench_tp_overlap.py runs on the GPUs meanwhile); the trainer then finds
them by fingerprint. The exact torchrun command of each launch is printed and
stored in the JSON.

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

Per configuration it reports: tokens/s (global and per GPU) from the synchronised wall clock
over the steps after ``WARMUP`` (compile and the first DeepSpeed step are excluded), MFU by the
trainer's formula (6N + 12 L d s per token, over 989.4 TFLOP/s times the world size), the
trainer's per-phase GPU times (CUDA events), peak memory per rank, and the loss of each step.

Derived: DP2 weak-scaling efficiency (per-GPU tokens/s of dp2 over dp1, both at the recipe's
micro-batch with no accumulation: a gradient reduction and an optimizer step every micro-batch,
the hardest case); the gain of each overlap (DP all-reduce/overlap_comm, TP chunks 1/2/4,
sequence parallelism, pipeline micro-batches); and the largest |loss difference| of each
TP2/PP2 run against the one-GPU run of the same global batch (32 samples: 4 accumulated
micro-batches of 8) over the same steps (20 for the defaults), which must stay within
``LOSS_TOLERANCE`` (bf16; see ``compare_losses``).

Measured results and the exact device commands: benchmarks/RESULTS.md ("Two H200s").
Test the script on CPU first: ``--cpu --quick`` (tiny recipe, gloo, 2 processes, ~6 minutes).

The JSON is rewritten after every launch, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU_CONFIG = "configs/gpt-1.3b.yaml"
CPU_CONFIG = "configs/tiny-cpu.yaml"
# Enough text for ~2M tokens: the longest run reads 20 x 32 samples of 2049 tokens.
GPU_DATA = ["data.max_source_bytes=8000000", "data.num_workers=16"]
CPU_DATA: list[str] = []  # the tiny recipe's own corpus
WARMUP = 4  # steps left out of the throughput (compile, first DeepSpeed step, allocator growth)
LOSS_TOLERANCE = 2e-2  # max |loss - loss of the one-GPU run|, bf16 (see compare_losses)
# NCCL multicast (NVLS) stays off on the lent machines: a program that uses it can take a shared
# host's GPUs out of service (KINDS.md).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# TP's chunked all-gather/reduce-scatter overlaps the GEMMs only if the GPU starts kernels in
# issue order (one hardware queue), as Megatron-LM requires too.
TP_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@dataclass(frozen=True)
class Variant:
    name: str
    nproc: int
    overrides: tuple[str, ...]
    steps: int  # full mode; quick mode uses quick_steps
    quick_steps: int
    what: str
    env: dict = field(default_factory=dict)
    dp_max_ctas: int | None = None  # attach_dp_overlap's max_ctas

    def steps_for(self, quick: bool) -> int:
        return self.quick_steps if quick else self.steps


def _v(name, nproc, overrides, what, steps=30, quick_steps=12, env=None, dp_max_ctas=None) -> Variant:
    return Variant(name, nproc, tuple(overrides), steps, quick_steps, what, dict(env or {}), dp_max_ctas)


MB8 = ["train.micro_batch_size=8"]
# DP weak scaling runs the recipe's own micro-batch ({mb}: read from the config at launch), no accumulation
GB_MB, GB_2MB, GB_4MB, GB_8MB = ("train.global_batch_size={mb}", "train.global_batch_size={mb2}",
                                 "train.global_batch_size={mb4}", "train.global_batch_size={mb8}")
GB32, GB64 = "train.global_batch_size=32", "train.global_batch_size=64"
NO_DP_OVERLAP = "parallel.overlap.dp_overlap_comm=false"
Z1 = "parallel.zero_stage=1"  # TP with LAMB and a bf16 pipeline with LAMB need ZeRO-1 (deepspeed_config)
TP2 = ["parallel.tp=2", Z1]
PP2 = ["parallel.pp=2", Z1]
# The larger model of the 4/8-GPU runs (issue 9): 13B, 40 layers x 5120, 40 heads of 128, on the
# 1.3B recipe's data and optimizer; micro-batch 4, global batch 32. On CPUs (--cpu) the same
# layouts run a tiny model of the same proportions instead.
BIG = ["model.n_layer=40", "model.d_model=5120", "model.n_head=40", "train.micro_batch_size=4", GB32]
BIG_CPU = {"model.n_layer=40": "model.n_layer=4", "model.d_model=5120": "model.d_model=128",
           "model.n_head=40": "model.n_head=8"}
PARITY = dict(steps=20, quick_steps=20)  # loss comparisons always run 20 steps of global batch 32
SHORT = dict(steps=12, quick_steps=8)  # throughput-only configurations
BIG_STEPS = dict(steps=10, quick_steps=7)  # 13B: ~2.5 s a step on four H200s; WARMUP of them not timed

CONFIGS: dict[str, Variant] = {v.name: v for v in [
    _v("dp1", 1, [GB_MB], "1 GPU, the recipe (ZeRO-0, its micro-batch, no accumulation): weak-scaling baseline"),
    _v("dp1-gb32", 1, [*MB8, GB32], "1 GPU, 4 x 8 accumulated: the loss reference for TP2/PP2", **PARITY),
    _v("dp2", 2, [GB_2MB], "DP2, the recipe (ZeRO-0) + bucketed all-reduce during backward (attach_dp_overlap)"),
    _v("dp2-nooverlap", 2, [GB_2MB, NO_DP_OVERLAP], "DP2 ZeRO-0, DeepSpeed's all-reduce after backward "
       "(the trainer as committed)"),
    _v("dp2-again", 2, [GB_2MB], "dp2 once more in the same launch (run-to-run spread)"),
    _v("dp2-nooverlap-again", 2, [GB_2MB, NO_DP_OVERLAP], "dp2-nooverlap once more"),
    _v("dp2-ctas8", 2, [GB_2MB], "dp2 with the overlapped all-reduces on a DP communicator of at most 8 CTAs",
       dp_max_ctas=8),
    _v("dp1-again", 1, [GB_MB], "dp1 once more (beside dp1, on the other GPU)"),
    _v("dp2-gb32", 2, [*MB8, GB32], "DP2 ZeRO-0 + overlap, 2 x 8 accumulated per GPU: loss parity", **PARITY),
    _v("dp2-z1", 2, [GB_2MB, Z1], "DP2 ZeRO-1, overlap_comm on (reduce in backward; LAMB on flat partitions)",
       **SHORT),
    _v("dp2-z1-nooverlap", 2, [GB_2MB, Z1, NO_DP_OVERLAP], "DP2 ZeRO-1, overlap_comm off", **SHORT),
    _v("tp2-sp-c2", 2, [*TP2, *MB8, GB32, "parallel.overlap.tp_chunks=2"],
       "TP2 + sequence parallel, all-gather/reduce-scatter in 2 chunks (the default)", env=TP_ENV, **PARITY),
    _v("tp2-sp-c1", 2, [*TP2, *MB8, GB32, "parallel.overlap.tp_chunks=1"], "TP2 + SP, unchunked collectives",
       env=TP_ENV, **SHORT),
    _v("tp2-sp-c4", 2, [*TP2, *MB8, GB32, "parallel.overlap.tp_chunks=4"], "TP2 + SP, 4 chunks", env=TP_ENV, **SHORT),
    _v("tp2-nosp", 2, [*TP2, *MB8, GB32, "parallel.sequence_parallel=false"], "TP2, no sequence parallelism "
       "(all-reduces)", env=TP_ENV, **SHORT),
    _v("tp2-nosp-eager", 2, [*TP2, *MB8, GB32, "parallel.sequence_parallel=false", "model.compile=false"],
       "TP2 without torch.compile (a control: the compiled TP blocks' gradients)", env=TP_ENV, steps=3, quick_steps=3),
    # the pipelines share a launch with the TP runs, so they run with CUDA_DEVICE_MAX_CONNECTIONS=1 too
    _v("pp2-m4", 2, [*PP2, *MB8, GB32], "PP2 1F1B, 4 micro-batches of 8 (bubble 1/5)", env=TP_ENV, **PARITY),
    _v("pp2-m8", 2, [*PP2, *MB8, GB64], "PP2 1F1B, 8 micro-batches of 8 (bubble 1/9)", env=TP_ENV, **SHORT),
    # four GPUs (nvidia-h200-x4): DP4 weak scaling of the 1.3B recipe, and the 13B model in 3D layouts
    _v("dp4", 4, [GB_4MB], "DP4, the recipe (ZeRO-0) + bucketed all-reduce during backward", **SHORT),
    _v("dp4-nooverlap", 4, [GB_4MB, NO_DP_OVERLAP], "DP4 ZeRO-0, all-reduce after backward", **SHORT),
    _v("13b-tp4", 4, [*BIG, "parallel.tp=4", Z1], "13B, TP4 + SP (unchunked), 8 x 4 accumulated", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4-c2", 4, [*BIG, "parallel.tp=4", Z1, "parallel.overlap.tp_chunks=2"],
       "13B, TP4 + SP, collectives in 2 chunks overlapped with the GEMMs", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4-nosp", 4, [*BIG, "parallel.tp=4", Z1, "parallel.sequence_parallel=false"],
       "13B, TP4 with all-reduces (no sequence parallelism)", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp2pp2", 4, [*BIG, "parallel.tp=2", "parallel.pp=2", Z1], "13B, TP2 x PP2, 1F1B over 8 micro-batches of 4",
       env=TP_ENV, **BIG_STEPS),
    _v("13b-tp2dp2", 4, [*BIG, "parallel.tp=2", Z1], "13B, TP2 x DP2 (ZeRO-1, overlap_comm), 4 x 4 accumulated per replica",
       env=TP_ENV, **BIG_STEPS),
    _v("13b-tp2dp2-nooverlap", 4, [*BIG, "parallel.tp=2", Z1, NO_DP_OVERLAP], "13B, TP2 x DP2, ZeRO-1 overlap_comm off",
       env=TP_ENV, **BIG_STEPS),
    # eight GPUs (nvidia-h200-x8, issue 9 as written): DP8, and the 13B over TP x PP x DP
    _v("dp8", 8, [GB_8MB], "DP8, the recipe (ZeRO-0) + bucketed all-reduce during backward", **SHORT),
    _v("dp8-nooverlap", 8, [GB_8MB, NO_DP_OVERLAP], "DP8 ZeRO-0, all-reduce after backward", **SHORT),
    _v("13b-tp2pp2dp2", 8, [*BIG, GB64, "parallel.tp=2", "parallel.pp=2", Z1],
       "13B, TP2 x PP2 x DP2, 1F1B over 8 micro-batches of 4 per replica", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp2pp2dp2-nooverlap", 8, [*BIG, GB64, "parallel.tp=2", "parallel.pp=2", Z1, NO_DP_OVERLAP],
       "13B, TP2 x PP2 x DP2, ZeRO-1 overlap_comm off", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4dp2", 8, [*BIG, "parallel.tp=4", Z1], "13B, TP4 + SP x DP2, 4 x 4 accumulated per replica",
       env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4dp2-nooverlap", 8, [*BIG, "parallel.tp=4", Z1, NO_DP_OVERLAP], "13B, TP4 x DP2, overlap_comm off",
       env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4dp2-nosp", 8, [*BIG, "parallel.tp=4", Z1, "parallel.sequence_parallel=false"],
       "13B, TP4 x DP2 with all-reduces (no sequence parallelism)", env=TP_ENV, **BIG_STEPS),
    _v("13b-tp4dp2-c2", 8, [*BIG, "parallel.tp=4", Z1, "parallel.overlap.tp_chunks=2"],
       "13B, TP4 x DP2, TP collectives in 2 chunks overlapped with the GEMMs", env=TP_ENV, **BIG_STEPS),
]}

# The 4-GPU schedule (--schedule-4): 1-GPU reference, DP4, then the 13B layouts, most important first.
SCHEDULE_4 = "dp1;dp4+dp4-nooverlap;13b-tp4+13b-tp2pp2+13b-tp2dp2+13b-tp4-nosp+13b-tp2dp2-nooverlap+13b-tp4-c2"
# The 8-GPU schedule (--schedule 8), as issue 9 asks; one launch per 13B layout so that a failure
# (OOM, hang) costs only its own configurations.
SCHEDULE_8 = ("dp1;dp8+dp8-nooverlap;13b-tp2pp2dp2+13b-tp2pp2dp2-nooverlap;"
              "13b-tp4dp2+13b-tp4dp2-nooverlap+13b-tp4dp2-nosp+13b-tp4dp2-c2")
SCHEDULES = {"4": SCHEDULE_4, "8": SCHEDULE_8}

# Launches in order; the launches of one inner list run at the same time (1-GPU runs, one GPU each).
# Several names in one launch run one after another in the same torchrun world (one start-up).
SCHEDULE: list[list[tuple[str, ...]]] = [
    [("dp1",), ("dp1-gb32",)],
    [("dp2", "dp2-nooverlap")],
    [("tp2-sp-c2", "pp2-m4", "tp2-sp-c1", "tp2-nosp", "tp2-nosp-eager", "tp2-sp-c4", "pp2-m8")],
    [("dp2-gb32", "dp2-again", "dp2-z1", "dp2-z1-nooverlap")],
    [("dp1-again",)],
    [("dp2-ctas8", "dp2-nooverlap-again")],
]

LOSS_PAIRS = [  # (run, reference): same global batch, same data, same seed
    ("tp2-sp-c2", "dp1-gb32"), ("tp2-sp-c1", "dp1-gb32"), ("tp2-sp-c4", "dp1-gb32"), ("tp2-nosp", "dp1-gb32"),
    ("pp2-m4", "dp1-gb32"), ("dp2-gb32", "dp1-gb32"),
]
GAINS = [  # (what, faster-by-design, baseline)
    ("DP ZeRO-0 all-reduce in buckets during backward (attach_dp_overlap)", "dp2", "dp2-nooverlap"),
    ("DP ZeRO-0 overlap, repeated", "dp2-again", "dp2-nooverlap"),
    ("DP ZeRO-1 overlap_comm (DeepSpeed reduce during backward)", "dp2-z1", "dp2-z1-nooverlap"),
    ("TP chunks 2 vs 1 (all-gather pipelined with qkv GEMM)", "tp2-sp-c2", "tp2-sp-c1"),
    ("TP chunks 4 vs 1", "tp2-sp-c4", "tp2-sp-c1"),
    ("sequence parallel (chunks 1) vs all-reduce TP", "tp2-sp-c1", "tp2-nosp"),
    ("sequence parallel (chunks 2) vs all-reduce TP", "tp2-sp-c2", "tp2-nosp"),
    ("PP 8 vs 4 micro-batches (1F1B bubble 1/9 vs 1/5)", "pp2-m8", "pp2-m4"),
    ("DP4 ZeRO-0 all-reduce in buckets during backward", "dp4", "dp4-nooverlap"),
    ("13B TP4 chunks 2 vs 1", "13b-tp4-c2", "13b-tp4"),
    ("13B TP4 sequence parallel vs all-reduce TP", "13b-tp4", "13b-tp4-nosp"),
    ("13B TP2xDP2 ZeRO-1 overlap_comm", "13b-tp2dp2", "13b-tp2dp2-nooverlap"),
    ("DP8 ZeRO-0 all-reduce in buckets during backward", "dp8", "dp8-nooverlap"),
    ("13B TP2xPP2xDP2 ZeRO-1 overlap_comm", "13b-tp2pp2dp2", "13b-tp2pp2dp2-nooverlap"),
    ("13B TP4xDP2 ZeRO-1 overlap_comm", "13b-tp4dp2", "13b-tp4dp2-nooverlap"),
    ("13B TP4xDP2 sequence parallel vs all-reduce TP", "13b-tp4dp2", "13b-tp4dp2-nosp"),
    ("13B TP4xDP2 chunks 2 vs 1", "13b-tp4dp2-c2", "13b-tp4dp2"),
]


# ============================================================================ the worker (a rank)
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

    import megatrain.trainer as trainer_module
    from megatrain.config_load import load_config
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
    from megatrain.config_load import load_config
    from megatrain.parallel.init import init_distributed, shutdown_distributed
    from megatrain.train import setup_logging

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


# ============================================================================ the driver
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe_micro_batch(args) -> int:
    from megatrain.config_load import load_config

    return load_config(args.config, args.common).train.micro_batch_size


def launch_command(names: tuple[str, ...], nproc: int, args) -> list[str]:
    mb = recipe_micro_batch(args)
    def own(o: str) -> str:
        return (BIG_CPU.get(o, o) if args.cpu else o).format(mb=mb, mb2=2 * mb, mb4=4 * mb, mb8=8 * mb)

    variants = [{"name": n, "overrides": [*args.common,  # then the configuration's own, which win
                                          *(own(o) for o in CONFIGS[n].overrides),
                                          f"train.steps={CONFIGS[n].steps_for(args.quick)}"],
                 **({"dp_max_ctas": CONFIGS[n].dp_max_ctas} if CONFIGS[n].dp_max_ctas else {})} for n in names]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "benchmarks/parallel.py", "--worker", "--config", args.config, "--work-dir", args.work_dir,
        "--variants", json.dumps(variants),
    ]


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(proc: subprocess.Popen, handle, timeout: float, started: float) -> str:
    """Wait for a launch until ``timeout`` seconds after ``started``; stop it then. Its status."""
    status = "ok"
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        status = "timeout"
        _stop(proc)
    handle.close()
    if status == "ok" and proc.returncode:
        status = f"failed (exit {proc.returncode})"
    return status


def run_step(launches: list[tuple[str, ...]], args, deadline: float) -> list[dict]:
    """Start the launches of one schedule step at once, wait for all; returns launch records."""
    procs = []
    gpu = 0
    for names in launches:
        nprocs = {CONFIGS[n].nproc for n in names}
        envs = {json.dumps(CONFIGS[n].env, sort_keys=True) for n in names}
        assert len(nprocs) == 1 and len(envs) == 1, f"one launch needs one world size and one env: {names}"
        nproc = nprocs.pop()
        env = _child_env(CONFIGS[names[0]].env)
        if not args.cpu and len(launches) > 1:  # side by side: one GPU each
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu + i) for i in range(nproc))
            gpu += nproc
        for name in names:
            shutil.rmtree(Path(args.work_dir) / name, ignore_errors=True)
        command = launch_command(names, nproc, args)
        shown = " ".join(f"{k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES", *CONFIGS[names[0]].env) if k in env)
        printable = (shown + " " if shown else "") + shlex.join(command)
        print(f"\n$ {printable}", flush=True)
        log_path = Path(args.work_dir) / f"launch-{'+'.join(names)}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = log_path.open("w")
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append((names, printable, proc, handle, log_path, time.monotonic()))
    records = []
    for names, printable, proc, handle, log_path, started in procs:
        timeout = max(1.0, min(args.launch_timeout, deadline - time.monotonic()))
        status = _wait(proc, handle, timeout, started)
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        if status != "ok":
            print(f"--- {'+'.join(names)}: {status}; log tail:\n" + "\n".join(tail), flush=True)
        records.append({"names": list(names), "command": printable, "status": status,
                        "wall_s": time.monotonic() - started, "log": str(log_path)})
    return records


def summarize(name: str, work_dir: Path) -> dict | None:
    """One configuration's numbers from its ranks' files."""
    ranks = [json.loads(p.read_text()) for p in sorted((work_dir / name).glob("rank*.json"))]
    if not ranks:
        errors = [p.read_text()[-1500:] for p in sorted((work_dir / name).glob("error-rank*.txt"))]
        if errors:
            print(f"--- {name} failed:\n{errors[0]}", flush=True)
        return None
    r0 = ranks[0]
    world, tokens_per_step = r0["world_size"], r0["tokens_per_step"]
    steps = r0["steps"]
    timed = steps[WARMUP:] if len(steps) >= WARMUP + 3 else steps[1:]
    # a step ends when the slowest rank has synchronised: take the max over ranks per step
    walls = [max(r["steps"][i]["wall_s"] for r in ranks) for i in range(len(steps))][len(steps) - len(timed):]
    step_s = statistics.mean(walls)
    tokens_per_s = tokens_per_step / step_s
    peak = r0["peak_flops_per_gpu"]
    phase_names = sorted({k for r in ranks for s in r["steps"] for k in s["phases_ms"]})
    phases = {}
    for phase in phase_names:  # the mean over timed steps of the slowest rank's phase time
        per_step = [max(r["steps"][i]["phases_ms"].get(phase, 0.0) for r in ranks)
                    for i in range(len(steps) - len(timed), len(steps)) if any(r["steps"][i]["phases_ms"] for r in ranks)]
        if per_step:
            phases[phase] = statistics.mean(per_step)
    # the loss every rank reports is the global batch's; the last pipeline stage computes it
    loss_rank = max(ranks, key=lambda r: r["coords"]["pp"])
    return {
        "name": name, "what": CONFIGS[name].what if name in CONFIGS else "", "world_size": world,
        "layout": r0["layout"], "grad_accumulation": r0["grad_accumulation"], "tokens_per_step": tokens_per_step,
        "steps": len(steps), "timed_steps": len(timed), "step_s": step_s, "step_s_stdev": statistics.pstdev(walls),
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world,
        "mfu": tokens_per_s * r0["flops_per_token"] / (peak * world) if peak else None,
        "trainer_tokens_per_s_median": statistics.median(s["trainer_tokens_per_s"] for s in timed),
        "phases_ms": phases,
        "peak_allocated_gib": [r.get("peak_allocated_gib") for r in ranks],
        "peak_reserved_gib": [r.get("peak_reserved_gib") for r in ranks],
        "build_s": max(r["build_s"] for r in ranks), "losses": [s["loss"] for s in loss_rank["steps"]],
        "device": r0["device"], "overrides": r0["overrides"], "env": r0["env"],
        "per_rank": [{"rank": r["rank"], "wall_s": [s["wall_s"] for s in r["steps"]],
                      "trainer_step_time_s": [s["trainer_step_time_s"] for s in r["steps"]],
                      "build_s": r["build_s"]} for r in ranks],
    }


def compare_losses(results: dict[str, dict]) -> list[dict]:
    """Largest |loss difference| per step against the one-GPU run of the same global batch.

    Tolerance (bf16): the runs share seed, data and global batch, but TP splits every GEMM's
    reduction (row-parallel partial sums are rounded to bf16 before the cross-rank sum) and the
    pipeline/accumulation order differs, so logits differ by O(bf16 eps = 2^-8 ~ 4e-3) relative
    in places; the mean cross-entropy over 65k tokens averages most of that out, and the updates
    (LAMB, fp32 master weights) then move the runs apart slowly. 2e-2 absolute on a loss of
    ~7-11 is ~0.2%: far below the loss change over these steps, far above a bug (a wrong shard,
    a missing reduction or a double-counted gradient shows up as >1e-1 within a few steps)."""
    rows = []
    for run, ref in LOSS_PAIRS:
        if run not in results or ref not in results:
            continue
        a, b = results[run]["losses"], results[ref]["losses"]
        n = min(len(a), len(b))
        diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
        worst = max(range(n), key=lambda i: diffs[i])
        rows.append({"run": run, "reference": ref, "steps": n, "max_abs_diff": diffs[worst], "at_step": worst + 1,
                     "mean_abs_diff": statistics.mean(diffs), "tolerance": LOSS_TOLERANCE,
                     "within": diffs[worst] <= LOSS_TOLERANCE, "first_loss": b[0], "last_loss": b[n - 1]})
    return rows


def derived(results: dict[str, dict]) -> dict:
    out: dict = {"gains": []}
    if "dp1" in results and "dp2" in results:
        out["dp2_weak_scaling_efficiency"] = results["dp2"]["tokens_per_s_per_gpu"] / results["dp1"]["tokens_per_s_per_gpu"]
    for other in ("dp2-nooverlap", "dp2-again", "dp2-z1", "dp2-z1-nooverlap", "dp4", "dp4-nooverlap", "dp8", "dp8-nooverlap"):
        if "dp1" in results and other in results:
            out[f"{other}_weak_scaling_efficiency"] = (
                results[other]["tokens_per_s_per_gpu"] / results["dp1"]["tokens_per_s_per_gpu"])
    if "dp1-gb32" in results and "dp2-gb32" in results:  # same global batch: half the accumulation per GPU
        out["dp2_gb32_strong_scaling_efficiency"] = (
            results["dp2-gb32"]["tokens_per_s_per_gpu"] / results["dp1-gb32"]["tokens_per_s_per_gpu"])
    for what, on, off in GAINS:
        if on in results and off in results:
            out["gains"].append({"what": what, "on": on, "off": off,
                                 "gain": results[on]["tokens_per_s"] / results[off]["tokens_per_s"] - 1,
                                 "step_ms_on": 1e3 * results[on]["step_s"], "step_ms_off": 1e3 * results[off]["step_s"]})
    out["losses"] = compare_losses(results)
    return out


def print_table(results: dict[str, dict], extra: dict) -> None:
    print("\nconfig          world acc  step ms (sd)    tokens/s  tok/s/GPU    MFU   peak GiB/GPU      phases ms (slowest rank)")
    for r in results.values():
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   n/a"
        mem = "/".join(f"{m:.1f}" for m in r["peak_allocated_gib"] if m is not None) or "n/a"
        phases = " ".join(f"{k[:4]} {v:.0f}" for k, v in r["phases_ms"].items())
        print(f"{r['name']:15s} {r['world_size']:5d} {r['grad_accumulation']:3d} {1e3 * r['step_s']:8.1f} "
              f"({1e3 * r['step_s_stdev']:4.1f}) {r['tokens_per_s']:10.0f} {r['tokens_per_s_per_gpu']:10.0f} {mfu} "
              f"{mem:>14s}   {phases}")
    for key, value in extra.items():
        if key.endswith("scaling_efficiency"):
            print(f"{key}: {100 * value:.1f}%")
    for g in extra["gains"]:
        print(f"gain {g['what']}: {100 * g['gain']:+.1f}% ({g['step_ms_off']:.1f} -> {g['step_ms_on']:.1f} ms/step)")
    for c in extra["losses"]:
        print(f"loss {c['run']} vs {c['reference']}: max |diff| {c['max_abs_diff']:.2e} at step {c['at_step']} "
              f"(mean {c['mean_abs_diff']:.1e}, {c['steps']} steps, loss {c['first_loss']:.3f} -> {c['last_loss']:.3f}) "
              f"{'within' if c['within'] else 'OUTSIDE'} {c['tolerance']:.0e}")


def machine_info(args) -> dict:
    info = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "label": args.label}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    try:
        info["nvidia_smi_topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                                 timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    info["config_sha256"] = hashlib.sha256((ROOT / args.config).read_bytes()).hexdigest()[:16]
    return info


def _child_env(extra: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **SAFE_ENV, **extra)

    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def start_tp_overlap_check(args):
    """tests/megatrain/parallel/bench_tp_overlap.py on 2 GPUs (NCCL): TP correctness against the
    unsharded model in fp32, then one 4-layer 1.3B-shape forward + backward per overlap setting."""
    out = Path(args.work_dir) / "tp_overlap.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "tests/megatrain/parallel/bench_tp_overlap.py", "--out", str(out),
               *(["--check-only"] if args.cpu else [])]
    extra = {} if args.tp_overlap_connections == "unset" else {"CUDA_DEVICE_MAX_CONNECTIONS": args.tp_overlap_connections}
    env = _child_env(extra)
    if args.tp_overlap_connections == "unset":
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    printable = " ".join(f"{k}={v}" for k, v in extra.items()) + " " + shlex.join(command)
    print(f"$ {printable.strip()}", flush=True)
    log_path = Path(args.work_dir) / "tp_overlap.log"
    handle = log_path.open("w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, handle, log_path, out, printable.strip(), time.monotonic()


def finish_tp_overlap_check(check, timeout: float = 240.0) -> dict:
    proc, handle, log_path, out, printable, started = check
    status = _wait(proc, handle, timeout, started)
    lines = [l for l in log_path.read_text(errors="replace").splitlines() if l.startswith(("tp=", "check", "time"))]
    print("\n".join(lines) if status == "ok" else f"tp overlap check {status}:\n" +
          "\n".join(log_path.read_text(errors="replace").splitlines()[-30:]), flush=True)
    record = {"command": printable, "status": status, "wall_s": time.monotonic() - started, "lines": lines}
    if out.exists():
        record["result"] = json.loads(out.read_text())
    return record


def shard_command(args) -> list[str]:
    return [sys.executable, "-m", "megatrain.cli", "shard", "--config", args.config, *args.data]


def driver(args) -> int:
    started = time.monotonic()
    deadline = started + args.deadline
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine_info(args), "args": vars(args), "launches": [], "results": {}}

    def save() -> None:
        report["derived"] = derived(report["results"])
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))

    check = start_tp_overlap_check(args) if args.tp_overlap_check else None  # GPU work beside the CPU sharding
    command = shard_command(args)
    print("$ " + shlex.join(command), flush=True)
    t = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=_child_env({}), capture_output=True, text=True)
    report["shard"] = {"command": shlex.join(command), "seconds": time.monotonic() - t, "rc": done.returncode,
                       "summary": done.stdout[-2000:]}
    print(done.stdout[-1500:], done.stderr[-3000:] if done.returncode else "", flush=True)
    if check is not None:
        report["tp_overlap_check"] = finish_tp_overlap_check(check)
    save()
    if done.returncode:
        return 1

    schedule = parse_schedule(SCHEDULES.get(args.schedule, args.schedule)) if args.schedule else SCHEDULE
    wanted = set(args.only.split(",")) if args.only else set(CONFIGS)
    unknown = (wanted | {n for step in schedule for names in step for n in names}) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations: {sorted(unknown)}; known: {list(CONFIGS)}")
    for step in schedule:
        launches = [tuple(n for n in names if n in wanted) for names in step]
        launches = [names for names in launches if names]
        if not launches:
            continue
        if deadline - time.monotonic() < args.min_launch_s:
            report["launches"].append({"names": [n for l in launches for n in l], "status": "skipped: deadline"})
            print(f"skipped (deadline): {launches}", flush=True)
            continue
        for record in run_step(launches, args, deadline):
            report["launches"].append(record)
            for name in record["names"]:
                summary = summarize(name, Path(args.work_dir))
                if summary is not None:
                    report["results"][name] = summary
        save()
        print_table(report["results"], report["derived"])
    report["wall_s"] = time.monotonic() - started
    save()
    print_table(report["results"], report["derived"])
    return 0 if all(r["status"] == "ok" for r in report["launches"]) else 1


def parse_schedule(text: str) -> list[list[tuple[str, ...]]]:
    """'a+b;c|d' -> [[(a, b)], [(c,), (d,)]]: ';' between steps, '|' between launches that run at
    the same time (one GPU each), '+' between configurations of one launch."""
    return [[tuple(launch.split("+")) for launch in step.split("|")] for step in text.split(";") if step]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help="run as one torchrun rank (the driver starts these)")
    p.add_argument("--variants", help="worker: JSON list of {name, overrides}")
    p.add_argument("--config", default=None, help=f"recipe (default {GPU_CONFIG}, or {CPU_CONFIG} with --cpu)")
    p.add_argument("--work-dir", default="runs/bench/parallel")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--quick", action="store_true", help="fewer steps for throughput-only configurations")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--schedule", default=None, help="launch order instead of SCHEDULE: 'a+b;c|d' (parse_schedule), or 4 / 8 for SCHEDULE_4 / SCHEDULE_8")
    p.add_argument("--cpu", action="store_true", help="2 CPU processes, gloo, the tiny recipe (tests the script)")
    p.add_argument("--label", default=os.environ.get("MEGATRAIN_COMMIT", ""), help="what was measured (commit)")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole driver")
    p.add_argument("--launch-timeout", type=float, default=400.0)
    p.add_argument("--min-launch-s", type=float, default=45.0, help="start no launch with less time left")
    p.add_argument("--set", dest="extra", action="append", default=[], help="extra override for every run")
    p.add_argument("--tp-overlap-check", action="store_true",
                   help="first run tests/megatrain/parallel/bench_tp_overlap.py on 2 GPUs (beside the sharding)")
    p.add_argument("--tp-overlap-connections", default="1", help="its CUDA_DEVICE_MAX_CONNECTIONS ('unset' for none)")
    args = p.parse_args(argv)
    if args.config is None:
        args.config = CPU_CONFIG if args.cpu else GPU_CONFIG
    args.data = CPU_DATA if args.cpu else GPU_DATA
    cpu = ["train.device=cpu", "parallel.backend=gloo"] if args.cpu else []
    # one learning-rate schedule whatever train.steps is, so runs of 12 and 20 steps compare step by step
    # a hung collective ends the launch in minutes, not the default 10
    args.common = [*args.data, *cpu, "optim.decay_steps=20", "reliability.collective_timeout_s=180", *args.extra]
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.cpu else "4")  # every launch the same: torchrun sets 1 only for several ranks
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
