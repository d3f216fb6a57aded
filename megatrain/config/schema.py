"""Every knob of a megatrain run, as typed pydantic models with documented defaults.

A recipe is a YAML file in ``configs/`` that sets the fields which differ from these defaults;
``megatrain.config.load_config(path, overrides)`` reads it and validates it against ``Config``.
Validators here check what one field cannot say alone (divisibility, ranges across sections), so
a bad config fails before any model is built. This module imports neither torch nor prefect: the
Prefect worker validates campaigns without loading the engine. Which knobs a checkpoint survives
(and the fingerprint of a run's math) is a policy of its own: ``megatrain/config/compat.py``.
The model's section (``ModelConfig``: a family is a choice of parts) is ``megatrain/config/model.py``,
the data's (sources, mixtures, sharding, reading) ``megatrain/config/data.py``, the reliability
policy's ``megatrain/config/reliability.py``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from megatrain.config.data import DataConfig
from megatrain.config.model import ModelConfig
from megatrain.config.reliability import AnomalyConfig, FaultConfig, ReliabilityConfig, SelfCheckConfig  # noqa: F401
from megatrain.config.section import _Section
from megatrain.errors import DeterministicError


class OverlapConfig(_Section):
    """Communication/compute overlap switches (each can be turned off to measure its effect)."""

    dp_overlap_comm: bool = Field(True, description="ZeRO reduce-scatter overlapped with backward")
    dp_prefetch: bool = Field(True, description="prefetch the first data-parallel all-gather")
    tp_chunks: int = Field(1, ge=1, description="TP all-gather/reduce-scatter chunks pipelined with GEMMs (1 = off: on 2 NVLinked H200s 2 chunks were 7.6% slower)")
    pp_decouple_send_recv: bool = True
    ep_shared_expert: bool = Field(True, description="expert parallelism: the shared expert computed while the "
                                   "routed rows travel to their experts' ranks, forward and backward")


class InitConfig(_Section):
    """How ranks find each other and build their process groups (``megatrain/parallel/init.py``;
    ``benchmarks/init.py`` measures every choice)."""

    store: Literal["tcp", "redis", "auto"] = Field(
        "tcp", description="rendezvous store: tcp = torch's libuv TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's "
        "agent store under torchrun; measured faster, benchmarks/RESULTS.md); redis = a RedisStore at redis_url "
        "(no rank hosts it, it survives rank 0); auto = redis when a redis_url is set")
    redis_url: str | None = Field(None, description="redis://host:port/db for the store; default reliability.redis_url")
    groups: Literal["ordered", "default", "barrier"] = Field(
        "ordered", description="ordered: each rank creates only its own TP/DP/PP/stage groups, in one global order, "
        "with group-local synchronization; default: every rank calls new_group for every group (torch's default); "
        "barrier: default plus a global store barrier after each group (pre-2.1 PyTorch, MegaScale's O(n^2))")
    eager_nccl: bool = Field(True, description="NCCL: bind the device at init (device_id): eager communicator, "
                                               "subgroups by ncclCommSplit with no store traffic")
    join_timeout_s: float = Field(300.0, gt=0, description="how long a rank waits for all ranks to join; then "
                                                           "the error names the ranks that never did")
    meta_init: Literal["auto", "always", "never"] = Field(
        "auto", description="build the model on the meta device and materialize only this rank's stage and TP shard; "
        "auto = above 10B parameters (the 175B recipe never materializes a full replica)")


class ParallelConfig(_Section):
    """The 3D layout. ``dp=None`` means: whatever the world size leaves after tp * pp."""

    dp: int | None = Field(None, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0, description="expert parallelism (model.mlp=moe): the DP ranks are cut into groups of "
                    "ep that hold n_experts/ep experts each and exchange tokens by all-to-all; needs zero_stage 0, "
                    "tp 1, pp 1 (megatrain/parallel/expert_parallel.py says why)")
    cp: int = Field(1, gt=0, description="context parallelism: each sample's tokens split over cp ranks, which hold "
                    "the same parameters and reduce gradients with the data-parallel ranks (megatrain/parallel/"
                    "context_parallel.py); ranks ordered tp, cp, dp, pp")
    cp_mode: Literal["ring", "alltoall"] = Field(
        "ring", description="ring: K/V blocks passed around the cp ranks; alltoall (Ulysses): heads exchanged for "
        "the sequence, whole-sequence attention on n_head/cp heads (needs heads and KV heads divisible by cp)",
    )
    zero_stage: Literal[0, 1, 2, 3] = 1
    sequence_parallel: bool = True
    gpus_per_node: int = Field(8, gt=0, description="node size; tensor parallelism never crosses a node")
    world_size: int | None = Field(None, gt=0, description="expected world size, checked when set")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    node_loader: bool = Field(False, description="one data reader per node, shared memory to local ranks")
    overlap: OverlapConfig = OverlapConfig()
    init: InitConfig = InitConfig()

    def data_parallel_size(self, world_size: int) -> int:
        """The DP degree for a world size; raises if tp * pp * dp * cp cannot equal it."""
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {model_parallel}")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = {model_parallel * self.dp} != world size {world_size}"
            )
        return dp

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.tp > self.gpus_per_node:
            raise ValueError(f"tp ({self.tp}) must not exceed gpus_per_node ({self.gpus_per_node})")
        if self.world_size is not None:
            self.data_parallel_size(self.world_size)
        if self.ep > 1:
            self._check_expert_parallel()
        return self

    def _check_expert_parallel(self) -> None:
        """What composes with ep > 1 (megatrain/parallel/expert_parallel.py gives the reasons)."""
        if self.tp > 1 or self.pp > 1:
            raise ValueError(f"parallel.ep={self.ep} with parallel.tp={self.tp}, parallel.pp={self.pp}: expert "
                             "parallelism composes with data parallelism only (the experts have no tensor-parallel "
                             "form, and the pipeline engine reduces gradients itself); use tp 1 and pp 1")
        if self.zero_stage != 0:
            raise ValueError(f"parallel.ep={self.ep} with parallel.zero_stage={self.zero_stage}: DeepSpeed's ZeRO "
                             "partitions and reduces every gradient over the one data-parallel group and averages "
                             "expert gradient norms over it (inexact clipping); expert parallelism needs "
                             "parallel.zero_stage=0, where megatrain reduces the experts' gradients over the ranks "
                             "holding the same experts")
        dp = self.dp if self.world_size is None else self.data_parallel_size(self.world_size)
        if dp is not None and (dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep ({self.ep}) must divide the data-parallel size times parallel.cp "
                             f"({dp} * {self.cp}): EP groups are carved out of the replicas")


class OptimConfig(_Section):
    name: Literal["lamb", "adamw"] = "lamb"
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    max_trust_ratio: float = Field(10.0, gt=0, description="LAMB: clip of ||w|| / ||update||")
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0 disables")
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["cosine", "constant", "wsd"] = Field(
        "cosine", description="cosine: warm-up, then cosine decay to min_lr over decay_steps; wsd (warm-up, "
        "stable, decay): lr until the last decay_steps (default decay_fraction of train.steps), then 1-sqrt decay "
        "to min_lr - a run extended while stable resumes with no LR change; constant: lr after warm-up",
    )
    decay_steps: int | None = Field(
        None, gt=0, description="cosine: its length (default train.steps); wsd: the final decay's length"
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the share of train.steps spent decaying "
                                  "when decay_steps is not set")

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


class FP8Config(_Section):
    """FP8 GEMMs for the transformer blocks' linears (``train.precision: fp8``), through torchao's
    float8 training (``megatrain/precision/``). What converts: every ``nn.Linear`` inside
    ``model.blocks`` (attention qkv/proj, MLP fc/proj). What always stays in ``train.dtype``: the
    token and position embeddings, the LM head (tied to the embedding; its logits feed the loss),
    every norm, attention itself (SDPA/flex in bf16) and the optimizer's master weights. Linears
    whose in/out features are not multiples of 16 (``_scaled_mm``'s constraint) stay too.

    Scaling: torchao 0.18 only scales dynamically ("current scaling": each cast takes the amax of
    the very tensor it casts); the delayed scaling of earlier torchao (amax history buffers) was
    removed upstream, so an FP8 run keeps no scale state and its checkpoints hold exactly the
    bf16 run's tensors."""

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "tensorwise", description="torchao Float8LinearRecipeName. tensorwise: one scale per tensor (fastest on "
        "H100/H200); rowwise: one scale per row of every operand, power-of-2 scales (more accurate, slower); "
        "rowwise_with_gw_hp: rowwise, and the weight-gradient GEMM in bf16",
    )
    keep_first_block: bool = Field(False, description="leave block 0's linears in train.dtype")
    keep_last_block: bool = Field(False, description="leave the last block's linears in train.dtype")
    round_scales_to_power_of_2: bool | None = Field(
        None, description="round scales down to a power of 2; None keeps the recipe's choice (rowwise: on)"
    )
    emulate: bool = Field(
        False, description="torchao's emulation: FP8 casts with the GEMM in high precision. Runs on CPU and "
        "GPUs without FP8; for tests only (slow, and the only way fp8 runs without an FP8-capable GPU)",
    )
    experts: bool = Field(
        False, description="model.mlp=moe: the expert banks' grouped GEMMs in FP8 too (row-wise e4m3, "
        "megatrain/kernels/fp8_grouped.py; the weight gradient stays bf16). Off by default: where experts are "
        "narrow the casts cost more than the GEMMs save (moe-gpu-2b, d 1024, width 640, one H200: 131.3 ms per "
        "step against 107.8 in bf16); the casts grow with the rows' width, the GEMMs with width x width",
    )
    casts: Literal["torchao", "once", "fused"] = Field(
        "once", description="who casts the activations to e4m3 (megatrain/precision/fp8_casts.py; "
        "tensorwise only, other recipes keep torchao's). torchao: each Float8Linear casts its input in the "
        "forward and again in the backward. once: megatrain casts each activation once (the parallel block's "
        "normalised input once for qkv and fc) and the backward reuses the FP8 copy; same numbers, 9 input "
        "casts per 3 parallel blocks instead of 24 (measured 0.8% faster on an H200 at 1.3B, within the noise). "
        "fused: once, with the GeLU output's amax and cast in Triton (megatrain/kernels/fp8_gelu_triton.py; "
        "bit-identical; measured 5% slower before a fix of an input copy that torch.compile made, not "
        "re-measured since: benchmarks/RESULTS.md)",
    )


class BatchSplitError(DeterministicError, ValueError):
    """A global batch the data-parallel ranks cannot split (``TrainConfig.grad_accumulation_steps``)."""


class TrainConfig(_Section):
    steps: int = Field(100, gt=0, description="optimizer steps")
    seq_len: int | None = Field(
        None, gt=0, description="training sequence length, <= model.seq_len (a shorter first stage of a "
        "campaign); default model.seq_len",
    )
    micro_batch_size: int = Field(4, gt=0, description="samples per rank per forward")
    global_batch_size: int = Field(4, gt=0, description="samples per optimizer step, all ranks")
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    precision: Literal["bf16", "fp8"] = Field(
        "bf16", description="the GEMM precision of the transformer blocks. bf16: every matmul in train.dtype "
        "(bf16 on GPU, fp32 on CPU, as before); fp8: the blocks' linears as FP8 GEMMs (train.fp8; needs a GPU "
        "of compute capability >= 8.9, e.g. H100/H200, unless train.fp8.emulate)",
    )
    fp8: FP8Config = FP8Config()
    log_interval: int = Field(10, gt=0)
    run_dir: str = Field("runs/default", description="logs, metrics and reports of this run")
    # held-out evaluation (megatrain/evaluate/heldout.py): needs a validation split (data.val_fraction > 0)
    eval_interval: int = Field(
        50, ge=0, description="validation loss and perplexity every this many steps and at the last step, on "
        "the fixed held-out set; 0 = never (runs without a validation split skip it)",
    )
    eval_batches: int = Field(
        2, gt=0, description="size of the fixed held-out set, in global batches (global_batch_size samples each); "
        "a mixture holds that many of each component's held-out samples"
    )
    eval_weights: dict[str, float] | None = Field(
        None, description="the validation mix: a weight per data component (normalised over those with a held-out "
        "split). val_loss is this mix of the components' held-out losses, logged beside each component's "
        "(val_loss/<name>), so the curve stays comparable when a stage changes the training weights; 0 evaluates a "
        "component outside the mix. Default: a campaign's first stage's data weights (every stage), else this "
        "run's own data weights",
    )
    # tracking sinks of the metrics logger (megatrain/observe/metrics.py); metrics.jsonl is always written
    tensorboard: bool = Field(True, description="TensorBoard event files for every run")
    tensorboard_dir: str | None = Field(None, description="where the event files go; default <run_dir>/tb")
    wandb_project: str | None = Field(None, description="also log to this Weights & Biases project (needs wandb)")
    mlflow_tracking_uri: str | None = Field(None, description="also log to this MLflow tracking URI (needs mlflow)")

    def grad_accumulation_steps(self, dp: int) -> int:
        """Micro-batches per rank per step. A global batch the ``dp`` ranks cannot split into whole
        micro-batches raises ``BatchSplitError``: deterministic (a ConfigError-class failure: a
        rank prints it in one line, no restart) and a ValueError, which a pydantic validator
        reports as a field error."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise BatchSplitError(
                f"train.global_batch_size {self.global_batch_size} is not divisible by train.micro_batch_size * dp "
                f"= {self.micro_batch_size} * {dp} = {per_step} (dp: the data-parallel size, world size / (tp * pp))"
            )
        return self.global_batch_size // per_step

    @field_validator("eval_weights")
    @classmethod
    def _a_mix(cls, weights: dict[str, float] | None) -> dict[str, float] | None:
        if weights is not None and (any(not (w >= 0 and math.isfinite(w)) for w in weights.values())
                                    or not any(w > 0 for w in weights.values())):
            raise ValueError(f"train.eval_weights {weights}: weights must be finite and >= 0, at least one > 0")
        return weights

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self


class CheckpointConfig(_Section):
    interval: int = Field(50, gt=0, description="save every this many steps")
    memory_interval: int = Field(
        0, ge=0, description="also snapshot into the node's checkpoint keeper (host RAM, a process that outlives "
        "the ranks) every this many steps; a restart restores from it when it is newer than the durable store "
        "(megatrain/checkpoint/memory.py); 0: off")
    staging_dir: str | None = Field(
        None, description="fast local disk for stage 1; default <train.run_dir>/staging (a run owns its files)")
    durable_url: str | None = Field(
        None, description="fsspec URL for committed checkpoints; default <train.run_dir>/checkpoints")
    keep_last: int = Field(3, gt=0)
    keep_every: int | None = Field(None, gt=0, description="also keep every step divisible by this")
    upload_retries: int = Field(5, ge=0, description="retries per file (and per commit) before a step is given up")
    upload_backoff_s: float = Field(1.0, ge=0, description="first retry delay; doubles each retry")
    upload_backoff_max_s: float = Field(60.0, ge=0, description="cap of the doubling retry delay")
    upload_mode: Literal["thread", "external"] = Field(
        "thread", description="thread: each rank uploads its staged files in a background thread and rank 0 "
        "commits; external: the trainer only stages (and writes staged.json), the Prefect flow uploads"
    )
    commit_timeout_s: float = Field(
        600.0, gt=0, description="how long the committer waits for every rank's upload (or staging, external mode)"
    )
    resume: bool = Field(True, description="restore the newest verified checkpoint at start")
    init_from: str | None = Field(
        None, description="when this run has no checkpoint of its own, start from the newest committed one "
        "here (weights and optimizer state only: a new stage of a campaign keeps its own step count and data); "
        "'hf:<local dir>' starts from a transformers checkpoint instead (weights only, megatrain/interop/hf.py)",
    )
    allow_schedule_change: bool = Field(
        False, description="on resume, accept a checkpoint written with another global batch size, LR schedule or "
        "optimizer hyper-parameters (the change is recorded in the checkpoint's history); model, optimizer kind, "
        "data order and seed must still match",
    )
    resume_lr: Literal["exact", "redecay", "rewarm"] = Field(
        "exact", description="on resume, when this run's LR schedule would not continue the checkpoint's (it "
        "gives a step already trained another LR, as when a WSD run is extended after its decay began or after "
        "it finished; or a step to come another LR than the checkpoint's schedule at this run's length): exact "
        "refuses, naming the step; redecay decays from the LR the checkpoint's run had at the resume step to "
        "optim.min_lr by train.steps; rewarm goes linearly from that LR to this run's schedule over "
        "checkpoint.rewarm_steps, then follows it. Either is recorded in the checkpoint history and kept by later "
        "resumes; an exact resume is never changed (megatrain/optim/schedule.py)",
    )
    rewarm_steps: int | None = Field(
        None, gt=0, description="resume_lr=rewarm: the steps back up to the schedule (default optim.warmup_steps, "
        "at least 1)")


class Config(_Section):
    """One training run: the recipe every engine part is built from."""

    name: str = "megatrain"
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    reliability: ReliabilityConfig = ReliabilityConfig()

    @model_validator(mode="after")
    def _check(self) -> Config:
        for name, url in (("parallel.init.redis_url", self.parallel.init.redis_url),
                          ("reliability.redis_url", self.reliability.redis_url)):
            if url and urlsplit(url).password is not None:  # a config is copied into run dirs, ConfigMaps, reports
                raise ValueError(f"{name}: the URL carries a password; remove it and pass it in the environment "
                                 "variable MEGATRAIN_REDIS_PASSWORD (megatrain/launch/redis_client.py)")
        tp = self.parallel.tp
        if self.model.n_head % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide model.n_head ({self.model.n_head})")
        if self.model.kv_heads % tp:
            # Rule: KV heads are sharded like query heads, never replicated, so every TP rank holds
            # whole groups (its n_head/tp query heads and the n_kv_head/tp KV heads they read).
            raise ValueError(
                f"parallel.tp ({tp}) must divide model.n_kv_head ({self.model.kv_heads}): KV heads are sharded over "
                "tensor-parallel ranks, not replicated"
            )
        if self.model.ffn_dim % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide the MLP width ({self.model.ffn_dim})")
        if self.model.vocab_size % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide model.vocab_size ({self.model.vocab_size})")
        if self.parallel.ep > 1 and (self.model.mlp != "moe" or self.model.moe.n_experts % self.parallel.ep):
            raise ValueError(f"parallel.ep ({self.parallel.ep}) needs model.mlp=moe and must divide "
                             f"model.moe.n_experts ({self.model.moe.n_experts if self.model.mlp == 'moe' else 'no experts'})")
        if self.parallel.ep > 1 and self.train.precision == "fp8":
            raise ValueError(f"parallel.ep={self.parallel.ep} with train.precision=fp8: expert parallelism runs in fp32 "
                             "(train.dtype=fp32) and the FP8 expert GEMMs take bf16 operands; use ep 1 or bf16")
        if self.parallel.pp > self.model.n_layer:
            raise ValueError(f"parallel.pp ({self.parallel.pp}) exceeds model.n_layer ({self.model.n_layer})")
        self._check_context_parallel()
        if self.parallel.world_size is not None:
            self.train.grad_accumulation_steps(self.parallel.data_parallel_size(self.parallel.world_size))
        elif self.parallel.dp is not None:
            self.train.grad_accumulation_steps(self.parallel.dp)
        if self.train.precision == "fp8" and tp > 1:
            raise ValueError(
                "train.precision=fp8 with parallel.tp > 1 is not supported yet: tensor parallelism swaps the "
                "blocks' linears for megatrain's own column/row-parallel modules, which torchao's Float8Linear "
                "does not wrap (torchao's FP8 tensor parallelism works on DTensor layouts only); use tp=1"
            )
        if self.train.eval_weights is not None:
            names = [c.name for c in self.data.components()]
            unknown = sorted(set(self.train.eval_weights) - set(names))
            if unknown:
                raise ValueError(f"train.eval_weights names {unknown}, which are not components of this run's data "
                                 f"(its components: {names})")
        if self.train.seq_len is not None and self.train.seq_len > self.model.seq_len:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) must be <= model.seq_len ({self.model.seq_len})")
        # a run owns its files: checkpoints follow train.run_dir unless a field says otherwise
        run_dir = self.train.run_dir.rstrip("/")
        if self.checkpoint.staging_dir is None:
            self.checkpoint.staging_dir = f"{run_dir}/staging"
        if self.checkpoint.durable_url is None:
            self.checkpoint.durable_url = f"{run_dir}/checkpoints"
        return self

    def _check_context_parallel(self) -> None:
        """What parallel.cp needs of the model (megatrain/parallel/context_parallel.py says why)."""
        cp, tp, m = self.parallel.cp, self.parallel.tp, self.model
        if cp == 1:
            return
        if self.seq_len % (2 * cp * tp):
            raise ValueError(f"parallel.cp ({cp}): the sequence length ({self.seq_len}) must be divisible by 2 * cp * tp "
                             f"= {2 * cp * tp} (two chunks per cp rank, each split over the tp ranks)")
        if self.parallel.cp_mode == "alltoall":
            for name, heads in (("model.n_head", m.n_head), ("model.n_kv_head", m.kv_heads)):
                if (heads // tp) % cp:
                    raise ValueError(f"parallel.cp_mode=alltoall: {name} ({heads}) over parallel.tp ({tp}) gives "
                                     f"{heads // tp} heads per rank, not divisible by parallel.cp ({cp}); use "
                                     "parallel.cp_mode=ring or another cp")

    @property
    def seq_len(self) -> int:
        """The sequence length this run trains on."""
        return self.train.seq_len or self.model.seq_len

    @property
    def run_id(self) -> str:
        """Names this run's heartbeats and events: the recipe name and a hash of its run dir."""
        return f"{self.name}-{hashlib.sha256(self.train.run_dir.encode()).hexdigest()[:8]}"
