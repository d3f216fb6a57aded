"""The reliability policy of a run (``Config.reliability``): anomaly verdicts (NaN, loss spikes,
gradient explosions, FP8 overflow, a collapsing router), injected faults for the fault matrix, the
self-check's bars, heartbeats and the watcher's rules, restarts and node loss. Like the rest of
``megatrain/config``: pydantic, documented defaults, no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatrain.config.section import _Section


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
    fp8_check_interval: int = Field(10, gt=0, description="train.precision=fp8: measure the FP8 weights' amax "
                                    "and underflow every this many steps (megatrain/precision/guard.py; ~15 small "
                                    "kernels per converted linear, so not every step)")
    fp8_max_underflow: float = Field(0.05, gt=0, le=1, description="fp8: an anomaly when more than this "
                                     "fraction of the non-zero FP8 weights flush to zero in their e4m3 cast")
    # model.mlp=moe only (a dense model has no router): a collapsing router stops the run like a loss spike
    router_collapse_share: float | None = Field(
        0.9, gt=0, le=1, description="moe: an anomaly when one expert serves more than this fraction of a "
        "layer's tokens (its share of the routed slots x top_k) for router_collapse_steps steps in a row "
        "(None = off); balanced is top_k / n_experts, so the default only catches a real collapse")
    router_collapse_steps: int = Field(20, gt=0, description="moe: consecutive steps a collapse (or a dead "
                                       "expert) must last to be an anomaly: one bad batch is not a collapse")
    dead_experts: bool = Field(True, description="moe: an anomaly when an expert gets no token for "
                               "router_collapse_steps steps in a row")
    router_warmup_steps: int | None = Field(
        None, ge=0, description="moe: no router verdicts (and no streaks counted) up to this step; None = the "
        "LR warm-up, optim.warmup_steps. A fresh router is skewed (correlated hidden states at init: the "
        "worst layer's max/mean load was 6.5 at step 1 of moe-gpu-2b) and experts can sit idle for tens of "
        "steps while the balancing loss or bias takes hold; that is not a collapse to roll back")


class FaultConfig(_Section):
    """One injected fault (off unless listed; used by tests, the demo and the chaos benchmark)."""

    kind: Literal[
        "kill_rank", "hang_rank", "freeze_rank", "slow_rank", "nan_loss", "spike_loss",
        "storage_outage", "corrupt_checkpoint", "corrupt_shard", "kill_redis", "evict_node", "collapse_router",
        "kill_keeper", "corrupt_keeper", "host_down", "partition", "slow_link", "redis_host_down",
        "storage_host_down",
    ]
    step: int = Field(0, ge=0)
    rank: int = Field(0, ge=0)
    slowdown: float = Field(0.2, ge=0, description="slow_rank: extra fraction of step time")
    duration_s: float = Field(10.0, ge=0, description="storage_outage length; partition, redis_host_down, "
                              "storage_host_down: how long the host is cut off (Redis dead, moto frozen)")
    magnitude: float = Field(10.0, gt=0, description="spike_loss: loss multiplier")
    target: str | None = Field(
        None, description="corrupt_checkpoint/corrupt_shard: path or URL; kill_redis: pid or pid file"
    )
    once: bool = Field(True, description="fire only in the first attempt (marker file in run_dir)")
    node: int = Field(0, ge=0, description="evict_node: the node killed at `step` (a multi-node stage, "
                      "megatrain.launch.nodes); it then fails its self-check until the stage ends; host_down, "
                      "partition, slow_link: the node whose host (backend hosts, megatrain/launch/hosts.py) is "
                      "killed with its link removed, cut off for duration_s, or rate-limited")
    rate: str = Field("1mbit", description="slow_link: the tbf rate of the host's link")


class SelfCheckConfig(_Section):
    """Per-node diagnostics run before training (and after a fault); a node below a minimum is
    reported, and evicted on a cluster. Defaults pass on a 2-core CPU box: recipes for real
    hardware set real floors (an H200 does ~800 bf16 TFLOP/s and ~4000 GB/s copy). A GPU is also
    judged against its kind's expected figures (gpu_min_fraction, strict)."""

    min_gemm_tflops: float = Field(0.005, ge=0)
    min_memory_gbs: float = Field(0.2, ge=0, description="copy bandwidth, read + write")
    min_allreduce_busbw_gbs: float = Field(0.01, ge=0, description="intra-node all-reduce bus bandwidth")
    min_storage_mbs: float = Field(0.5, ge=0, description="write + read round trip of a test file")
    max_redis_rtt_ms: float = Field(50.0, gt=0, description="median PING round trip")
    storage_url: str | None = Field(None, description="where to write the test file; default checkpoint.durable_url")
    nproc_per_node: int | None = Field(None, gt=0, description="all-reduce processes; default GPUs, or 2 on CPU")
    gemm_size: int | None = Field(None, gt=0, description="square GEMM size; default 8192 on GPU, 1024 on CPU")
    copy_mb: int | None = Field(None, gt=0, description="copy test size; default 1024 on GPU, 64 on CPU")
    allreduce_mb: int | None = Field(None, gt=0, description="all-reduce message; default 1024 on GPU (2 H200s: "
                                     "329 GB/s bus bandwidth at 1 GiB, 299 at 256 MB, 269 at 64 MB), 8 on CPU")
    storage_mb: int = Field(8, gt=0)
    # The card's verdict (megatrain/reliability/gpu_verdict.py): GEMM, copy and all-reduce against
    # the expected figures of the card's kind (gpu_expected.py), beside the fixed floors above.
    gpu_min_fraction: float = Field(
        0.8, gt=0, le=1, description="a GPU figure below this x its card's expected figure is 'slow'. The "
        "expected figures are what a healthy card reaches, and healthy cards of one kind spread ~5% "
        "(H100s here: 769-798 TFLOP/s), so 0.8 leaves room for clocks and a busy host while a card 20% "
        "slow, which sets the pace of every synchronous step, is caught")
    strict: bool = Field(False, description="a slow card fails the self-check: the campaign stops before "
                         "training (a cluster evicts the node); off: a warning line and training goes on")
    fail_unknown_gpu: bool = Field(False, description="a card with no expected figures fails the self-check; "
                                   "off: its figures are recorded, verdict 'unknown card (no expected figures)'")
    expected_gpu: str | None = Field(None, description="judge against this card's figures (a name of "
                                     "gpu_expected's table or a CUDA device name, e.g. 'H100 SXM'); default "
                                     "the card CUDA reports, none on a CPU node")


class ReliabilityConfig(_Section):
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_timeout_s: float = Field(30.0, gt=0, description="silent this long = dead; step not advancing = hung")
    init_timeout_s: float = Field(
        900.0, gt=0, description="grace for the init phase (compile, checkpoint load) and for ranks never seen"
    )
    stall_factor: float | None = Field(
        20.0, gt=1, description="a step frozen longer than this x the ranks' median step-to-step time (and "
        "stall_min_s) while every rank is in compute or a collective is hung, before heartbeat_timeout_s "
        "(None = heartbeat_timeout_s only); data reads, saves, evaluation and logging keep the full timeout",
    )
    stall_min_s: float = Field(5.0, gt=0, description="the stall rule never calls a step hung sooner than this")
    redis_url: str | None = Field(None, description="redis://host:port/db; None = a local directory")
    collective_timeout_s: float = Field(600.0, gt=0, description="NCCL/gloo timeout")
    straggler_slowdown: float | None = Field(
        0.5, gt=0, description="heartbeat watcher: a rank whose forward time exceeds (1 + this) x its peers' "
        "median in straggler_steps of the last straggler_steps + 1 steps is reported slow (None = off)",
    )
    straggler_steps: int = Field(3, ge=1)
    evict_slow_host_after_s: float | None = Field(
        None, gt=0, description="hosts cluster (reliability/host_watch.py): a host named as a slow link (its "
        "ranks' steps over (1 + straggler_slowdown) x their own steady time while their forward is not, and "
        "its link's probe far slower than its peers') that stays slow this long is evicted like a lost "
        "host (on_node_loss decides what follows); None = named only, never evicted",
    )
    max_restarts: int = Field(3, ge=0, description="per stage")
    warm_standby: bool = Field(
        False, description="start the next attempt's rank processes (imported, waiting) once an attempt has "
        "trained a step, so a restart skips Python/torch/DeepSpeed imports (megatrain/launch/standby.py); costs one idle "
        "set of rank processes' memory and their import CPU, at low priority, during training",
    )
    fork_cpu_ranks: bool = Field(
        True, description="CPU ranks of a one-node stage are forked from a warm server in the launcher that "
        "imported torch, DeepSpeed and the trainer once (megatrain/launch/forked.py), instead of torchrun "
        "starting fresh interpreters: each attempt, restarts included, skips 2-4 s of imports per rank; "
        "ranks on a machine with a GPU are always fresh processes; off: fresh interpreters under torchrun (what "
        "a rank's sitecustomize or interpreter options need: a forked rank starts past them)",
    )
    on_node_loss: Literal["wait", "shrink"] = Field(
        "wait", description="a multi-node stage whose node fails its self-check: wait up to node_wait_s for it "
        "to pass, then fail the stage (wait), or go on without it after node_wait_s (shrink: dp shrinks, "
        "accumulation grows, same global batch; the node rejoins at a later attempt once it passes)",
    )
    node_wait_s: float = Field(0.0, ge=0, description="how long a node that failed its self-check may take to "
                               "pass it again before the policy applies (re-checked every few seconds)")
    max_rollbacks: int = Field(3, ge=0, description="per stage, within rollback_window_steps")
    rollback_window_steps: int = Field(1000, gt=0)
    rollback_skip_samples: int | None = Field(None, ge=0, description="data skipped on rollback; default one global batch per step rolled back")
    rollback_lr_scale: float = Field(1.0, gt=0, le=1.0)
    anomaly: AnomalyConfig = AnomalyConfig()
    selfcheck: SelfCheckConfig = SelfCheckConfig()
    faults: list[FaultConfig] = Field(default_factory=list)
