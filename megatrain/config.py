"""Every knob of a megatrain run, as typed pydantic models with documented defaults.

A recipe is a YAML file in ``configs/`` that sets the fields which differ from these defaults;
``megatrain.config_load.load_config(path, overrides)`` reads it and validates it against ``Config``.
Validators here check what one field cannot say alone (divisibility, ranges across sections), so
a bad config fails before any model is built. This module imports neither torch nor prefect: the
Prefect worker validates campaigns without loading the engine.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KernelConfig(_Section):
    """Which implementation each hot op uses. ``reference`` is plain torch and runs everywhere;
    ``fused`` is Triton (GPU only); ``auto`` picks fused on CUDA and reference elsewhere."""

    layernorm: Literal["reference", "fused", "auto"] = "auto"
    gelu: Literal["reference", "fused", "auto"] = "auto"
    cross_entropy: Literal["reference", "chunked", "fused", "auto"] = "auto"
    # sdpa: torch scaled_dot_product_attention (flash/cuDNN on GPU); flex: FlexAttention block mask
    # (skips masked blocks of a sliding window); reference: explicit softmax(QK^T)V, for tests.
    attention: Literal["sdpa", "flex", "reference", "auto"] = "auto"


class ModelConfig(_Section):
    """A GPT. Defaults are a small model; recipes set the real shapes."""

    vocab_size: int = Field(50304, gt=0, description="rows of the embedding (pad to a multiple of 64)")
    n_layer: int = Field(12, gt=0)
    n_head: int = Field(12, gt=0)
    d_model: int = Field(768, gt=0)
    d_ff: int | None = Field(None, gt=0, description="MLP hidden size; default 4 * d_model")
    seq_len: int = Field(1024, gt=0, description="tokens per sample the model is trained on")
    block: Literal["parallel", "serial"] = Field(
        "parallel", description="parallel: x + attn(ln(x)) + mlp(ln(x)) (MegaScale/PaLM); serial: pre-LN"
    )
    attention: Literal["full", "sliding"] = "full"
    window: int | None = Field(None, gt=0, description="sliding-window size in tokens (attention=sliding)")
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)
    kernels: KernelConfig = KernelConfig()
    activation_checkpointing: bool = False
    compile: bool = Field(False, description="wrap the model in torch.compile (GPU recipes)")

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def attended_context(self) -> int:
        """How many keys a query sees at most: seq_len, or the window when it is smaller."""
        if self.attention == "sliding" and self.window is not None:
            return min(self.window, self.seq_len)
        return self.seq_len

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.attention == "sliding":
            if self.window is None:
                raise ValueError("window: required when attention is 'sliding'")
            if self.window > self.seq_len:
                raise ValueError(f"window ({self.window}) must be <= seq_len ({self.seq_len})")
        return self


class OverlapConfig(_Section):
    """Communication/compute overlap switches (each can be turned off to measure its effect)."""

    dp_overlap_comm: bool = Field(True, description="ZeRO reduce-scatter overlapped with backward")
    dp_prefetch: bool = Field(True, description="prefetch the first data-parallel all-gather")
    tp_chunks: int = Field(1, ge=1, description="TP all-gather/reduce-scatter chunks pipelined with GEMMs (1 = off: on 2 NVLinked H200s 2 chunks were 7.6% slower)")
    pp_decouple_send_recv: bool = True


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
    zero_stage: Literal[0, 1, 2, 3] = 1
    sequence_parallel: bool = True
    gpus_per_node: int = Field(8, gt=0, description="node size; tensor parallelism never crosses a node")
    world_size: int | None = Field(None, gt=0, description="expected world size, checked when set")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    node_loader: bool = Field(False, description="one data reader per node, shared memory to local ranks")
    overlap: OverlapConfig = OverlapConfig()
    init: InitConfig = InitConfig()

    def data_parallel_size(self, world_size: int) -> int:
        """The DP degree for a world size; raises if tp * pp * dp cannot equal it."""
        model_parallel = self.tp * self.pp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {model_parallel}")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {model_parallel * self.dp} != world size {world_size}"
            )
        return dp

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.tp > self.gpus_per_node:
            raise ValueError(f"tp ({self.tp}) must not exceed gpus_per_node ({self.gpus_per_node})")
        if self.world_size is not None:
            self.data_parallel_size(self.world_size)
        return self


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
    schedule: Literal["cosine", "constant"] = "cosine"
    decay_steps: int | None = Field(None, gt=0, description="cosine length; default train.steps")

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        for beta in self.betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


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
    log_interval: int = Field(10, gt=0)
    run_dir: str = Field("runs/default", description="logs, metrics and reports of this run")

    def grad_accumulation_steps(self, dp: int) -> int:
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size * dp = {self.micro_batch_size} * {dp}"
            )
        return self.global_batch_size // per_step

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self


class DataConfig(_Section):
    """Where text comes from, how it becomes shards, and how shards are read."""

    sources: list[str] = Field(
        default_factory=lambda: ["stdlib"],
        description="paths, globs or URLs of .txt/.jsonl/.py/.md files; 'stdlib' = the Python "
        "standard library's own source, present offline wherever megatrain is installed",
    )
    text_field: str = Field("text", description="JSONL key holding the document text")
    max_source_bytes: int | None = Field(None, gt=0, description="stop reading sources after this many bytes")
    tokenizer: str = Field("bpe", description="'bpe' trains a byte-level BPE on the corpus, else a tokenizer.json path")
    bpe_vocab_size: int | None = Field(
        None, ge=257, description="vocabulary of the trained BPE; default model.vocab_size (never more)"
    )
    eos_token: str = Field("<|endoftext|>", description="the token that separates packed documents")
    shard_url: str = Field("data/shards", description="fsspec URL where shard versions are written")
    samples_per_shard: int = Field(1024, gt=0)
    num_workers: int = Field(0, ge=0, description="tokenizer processes while sharding; 0 = one per CPU core")
    seed: int = 1234
    shuffle_shards: int = Field(
        64, ge=0, description="shards shuffled together (each read once per epoch); 0 = one global permutation"
    )
    prefetch_batches: int = Field(4, ge=0, description="bounded queue of preprocessed batches; 0 = synchronous")
    on_bad_shard: Literal["error", "skip"] = "error"
    verify_checksums: bool = True


class CheckpointConfig(_Section):
    interval: int = Field(50, gt=0, description="save every this many steps")
    staging_dir: str = Field("runs/default/staging", description="fast local disk for stage 1")
    durable_url: str = Field("runs/default/checkpoints", description="fsspec URL for committed checkpoints")
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
        "here (weights and optimizer state only: a new stage of a campaign keeps its own step count and data)",
    )


class AnomalyConfig(_Section):
    """What counts as an anomaly (the trainer stops with a verdict; the flow rolls back)."""

    nan_check: bool = True
    loss_spike_zscore: float = Field(6.0, gt=0, description="robust z-score over the running window")
    loss_window: int = Field(50, gt=1)
    warmup_steps: int = Field(20, ge=0, description="no spike verdicts before this step")
    grad_norm_max: float | None = Field(None, gt=0, description="gradient-norm explosion threshold")
    grad_norm_zscore: float | None = Field(
        None, gt=0, description="also flag a grad norm this many robust z-scores above its running window"
    )
    min_history: int = Field(8, gt=1, description="losses in the window before spike verdicts are possible")


class FaultConfig(_Section):
    """One injected fault (off unless listed; used by tests, the demo and the chaos benchmark)."""

    kind: Literal[
        "kill_rank", "hang_rank", "slow_rank", "nan_loss", "spike_loss",
        "storage_outage", "corrupt_checkpoint", "corrupt_shard", "kill_redis",
    ]
    step: int = Field(0, ge=0)
    rank: int = Field(0, ge=0)
    slowdown: float = Field(0.2, ge=0, description="slow_rank: extra fraction of step time")
    duration_s: float = Field(10.0, ge=0, description="storage_outage length")
    magnitude: float = Field(10.0, gt=0, description="spike_loss: loss multiplier")
    target: str | None = Field(
        None, description="corrupt_checkpoint/corrupt_shard: path or URL; kill_redis: pid or pid file"
    )
    once: bool = Field(True, description="fire only in the first attempt (marker file in run_dir)")


class SelfCheckConfig(_Section):
    """Per-node diagnostics run before training (and after a fault); a node below a minimum is
    reported, and evicted on a cluster. Defaults pass on a 2-core CPU box: recipes for real
    hardware set real floors (an H200 does ~800 bf16 TFLOP/s and ~4000 GB/s copy)."""

    min_gemm_tflops: float = Field(0.005, ge=0)
    min_memory_gbs: float = Field(0.2, ge=0, description="copy bandwidth, read + write")
    min_allreduce_busbw_gbs: float = Field(0.01, ge=0, description="intra-node all-reduce bus bandwidth")
    min_storage_mbs: float = Field(0.5, ge=0, description="write + read round trip of a test file")
    max_redis_rtt_ms: float = Field(50.0, gt=0, description="median PING round trip")
    storage_url: str | None = Field(None, description="where to write the test file; default checkpoint.durable_url")
    nproc_per_node: int | None = Field(None, gt=0, description="all-reduce processes; default GPUs, or 2 on CPU")
    gemm_size: int | None = Field(None, gt=0, description="square GEMM size; default 8192 on GPU, 1024 on CPU")
    copy_mb: int | None = Field(None, gt=0, description="copy test size; default 1024 on GPU, 64 on CPU")
    allreduce_mb: int | None = Field(None, gt=0, description="all-reduce message; default 256 on GPU, 8 on CPU")
    storage_mb: int = Field(8, gt=0)


class ReliabilityConfig(_Section):
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="silent this long = dead; step not advancing = hung")
    init_timeout_s: float = Field(
        900.0, gt=0, description="grace for the init phase (compile, checkpoint load) and for ranks never seen"
    )
    redis_url: str | None = Field(None, description="redis://host:port/db; None = a local directory")
    collective_timeout_s: float = Field(600.0, gt=0, description="NCCL/gloo timeout")
    straggler_slowdown: float | None = Field(
        0.5, gt=0, description="heartbeat watcher: a rank whose forward time exceeds (1 + this) x its peers' "
        "median in straggler_steps of the last straggler_steps + 1 steps is reported slow (None = off)",
    )
    straggler_steps: int = Field(3, ge=1)
    max_restarts: int = Field(3, ge=0, description="per stage")
    max_rollbacks: int = Field(3, ge=0, description="per stage, within rollback_window_steps")
    rollback_window_steps: int = Field(1000, gt=0)
    rollback_skip_samples: int | None = Field(None, ge=0, description="data skipped on rollback; default one global batch per step rolled back")
    rollback_lr_scale: float = Field(1.0, gt=0, le=1.0)
    anomaly: AnomalyConfig = AnomalyConfig()
    selfcheck: SelfCheckConfig = SelfCheckConfig()
    faults: list[FaultConfig] = Field(default_factory=list)


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
        tp = self.parallel.tp
        if self.model.n_head % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide model.n_head ({self.model.n_head})")
        if self.model.ffn_dim % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide the MLP width ({self.model.ffn_dim})")
        if self.model.vocab_size % tp:
            raise ValueError(f"parallel.tp ({tp}) must divide model.vocab_size ({self.model.vocab_size})")
        if self.parallel.pp > self.model.n_layer:
            raise ValueError(f"parallel.pp ({self.parallel.pp}) exceeds model.n_layer ({self.model.n_layer})")
        if self.parallel.world_size is not None:
            self.train.grad_accumulation_steps(self.parallel.data_parallel_size(self.parallel.world_size))
        elif self.parallel.dp is not None:
            self.train.grad_accumulation_steps(self.parallel.dp)
        if self.train.seq_len is not None and self.train.seq_len > self.model.seq_len:
            raise ValueError(f"train.seq_len ({self.train.seq_len}) must be <= model.seq_len ({self.model.seq_len})")
        return self

    @property
    def seq_len(self) -> int:
        """The sequence length this run trains on."""
        return self.train.seq_len or self.model.seq_len

    @property
    def run_id(self) -> str:
        """Names this run's heartbeats and events: the recipe name and a hash of its run dir."""
        return f"{self.name}-{hashlib.sha256(self.train.run_dir.encode()).hexdigest()[:8]}"

    def fingerprint(self) -> str:
        """A short hash of everything that changes the math (not logging or paths)."""
        keep = self.model_dump(mode="json", exclude={"train": {"log_interval", "run_dir"}, "checkpoint": True, "reliability": True})
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
