"""The configurations of ``benchmarks/parallel.py``: every ``Variant`` (world size, config
overrides, steps), the launch schedules for 2, 4 and 8 GPUs, the loss pairs checked against the
one-GPU run and the overlap gains derived from pairs of runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU_CONFIG = "configs/gpt-1.3b.yaml"
CPU_CONFIG = "configs/tiny-cpu.yaml"
# Enough text for ~2M tokens: the longest run reads 20 x 32 samples of 2049 tokens.
GPU_DATA = ["data.max_source_bytes=8000000", "data.num_workers=16"]
CPU_DATA: list[str] = []  # the tiny recipe's own corpus
WARMUP = 4  # steps left out of the throughput (compile, first DeepSpeed step, allocator growth)
LOSS_TOLERANCE = 2e-2  # max |loss - loss of the one-GPU run|, bf16 (see compare_losses)
# NCCL multicast (NVLS) stays off: on a host whose GPUs are shared with other jobs, a program that
# uses it can take them out of service.
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

# Long context (issue 47): context parallelism against one GPU at the same global batch in tokens,
# 2 sequences a step. The schedules cp / cp4 run every configuration (and build the shards) at
# LONG_SEQ tokens (parallel.py sets model.seq_len): 16k on GPUs, 512 on the tiny CPU recipe.
LONG_SEQ = {"gpu": 16384, "cpu": 512}
LC = ["train.micro_batch_size=1", "train.global_batch_size=2"]
CP2 = [*LC, "parallel.cp=2"]

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
    # context parallelism (cp / cp4 schedules, at LONG_SEQ tokens)
    _v("lc-1gpu", 1, LC, "1 GPU, 2 long sequences accumulated: the loss reference for cp", **PARITY),
    _v("lc-cp2", 2, CP2, "CP2 ring: each sequence over 2 GPUs, two mirrored chunks each, K/V around the ring",
       **PARITY),
    _v("lc-cp2-a2a", 2, [*CP2, "parallel.cp_mode=alltoall"], "CP2 all-to-all (Ulysses): heads exchanged for "
       "the sequence", **PARITY),
    _v("lc-cp2-doc", 2, [*CP2, "model.attention_mask=document"], "CP2 ring with the document mask", **SHORT),
    _v("lc-dp2", 2, LC, "DP2 at the same tokens: one whole sequence per GPU (cp's cost against data parallelism)",
       **SHORT),
    _v("lc-cp4", 4, [*LC, "parallel.cp=4"], "CP4 ring: each sequence over 4 GPUs", **PARITY),
    _v("lc-cp2dp2", 4, CP2, "CP2 x DP2: two replicas, each sequence over 2 GPUs", **PARITY),
]}

# The context-parallel schedules (--schedule cp: 2 GPUs, cp4: 4), at LONG_SEQ tokens.
SCHEDULE_CP = "lc-1gpu;lc-cp2+lc-cp2-a2a+lc-cp2-doc+lc-dp2"
SCHEDULE_CP4 = "lc-1gpu;lc-cp4+lc-cp2dp2"
LONG_CONTEXT_SCHEDULES = ("cp", "cp4")

# The 4-GPU schedule (--schedule-4): 1-GPU reference, DP4, then the 13B layouts, most important first.
SCHEDULE_4 = "dp1;dp4+dp4-nooverlap;13b-tp4+13b-tp2pp2+13b-tp2dp2+13b-tp4-nosp+13b-tp2dp2-nooverlap+13b-tp4-c2"
# The 8-GPU schedule (--schedule 8), as issue 9 asks; one launch per 13B layout so that a failure
# (OOM, hang) costs only its own configurations.
SCHEDULE_8 = ("dp1;dp8+dp8-nooverlap;13b-tp2pp2dp2+13b-tp2pp2dp2-nooverlap;"
              "13b-tp4dp2+13b-tp4dp2-nooverlap+13b-tp4dp2-nosp+13b-tp4dp2-c2")
SCHEDULES = {"4": SCHEDULE_4, "8": SCHEDULE_8, "cp": SCHEDULE_CP, "cp4": SCHEDULE_CP4}

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
    ("lc-cp2", "lc-1gpu"), ("lc-cp2-a2a", "lc-1gpu"), ("lc-cp4", "lc-1gpu"), ("lc-cp2dp2", "lc-1gpu"),
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
    ("CP2 ring vs all-to-all", "lc-cp2", "lc-cp2-a2a"),
    ("CP2 vs DP2 at equal tokens (negative: what splitting a sequence costs)", "lc-cp2", "lc-dp2"),
    ("CP2 document mask vs causal", "lc-cp2-doc", "lc-cp2"),
]


def parse_schedule(text: str) -> list[list[tuple[str, ...]]]:
    """'a+b;c|d' -> [[(a, b)], [(c,), (d,)]]: ';' between steps, '|' between launches that run at
    the same time (one GPU each), '+' between configurations of one launch."""
    return [[tuple(launch.split("+")) for launch in step.split("|")] for step in text.split(";") if step]
