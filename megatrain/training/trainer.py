"""The trainer: builds the parts of a run in order, then steps them.

Build order: layout and process groups -> data -> model -> parallelize -> optimizer and schedule
-> DeepSpeed engine -> checkpointer (restores if a checkpoint exists) -> observers. Each observer
(metrics, checkpointer, heartbeats, anomaly detector) decides itself when to act; the loop only
calls them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.state import check_checkpointable
from megatrain.config import Config, ConfigError
from megatrain.data.loader import build_loader
from megatrain.data.index import ShardIndex, load_index
from megatrain.data.mixture import Component, Mixture, check_supply
from megatrain.data.shard import shard_components
from megatrain.evaluate.heldout import Evaluator
from megatrain.interop.checkpoint import write_run_record
from megatrain.interop.hf import hf_weights
from megatrain.model import active_parameter_count, expected_parameter_count
from megatrain.model.moe import end_step as moe_end_step
from megatrain.model.moe import set_aux_loss_scale
from megatrain.observe.metrics import MetricsLogger, StepMetrics, build_sinks
from megatrain.observe.mfu import flops_per_token, mfu, peak_flops
from megatrain.observe.straggler import StragglerMonitor
from megatrain.observe.timers import StepTimers
from megatrain.optim import Lamb, build_optimizer, build_scheduler
from megatrain.parallel.context_parallel import loss_weight, rank_chunks
from megatrain.parallel.deepspeed import DeepSpeedMPU, attach_lamb_segments, deepspeed_config
from megatrain.parallel.dims import ParallelDims, ProcessGroups, build_process_groups
from megatrain.parallel.expert_parallel import attach_expert_grad_sync
from megatrain.parallel.init import DistEnv
from megatrain.parallel.meta import build_parallel_model
from megatrain.parallel.pipeline import stage_micro_batch
from megatrain.parallel.zero_norms import attach_foreach_norms
from megatrain.parallel.zero_step import attach_fast_step
from megatrain.precision import FP8Guard, check_precision_supported
from megatrain.reliability.anomaly import AnomalyDetector, Verdict, write_verdict
from megatrain.reliability.faults import FaultInjector
from megatrain.reliability.heartbeat import HeartbeatWriter, make_sink
from megatrain.reliability.rollback import pending_for
from megatrain.observe.startup import StartupTimer

log = logging.getLogger("megatrain")

# Micro-batches reach a GPU from pinned host memory, made by the loader's prefetch thread: from
# pageable memory the driver stages each copy on the host first (9.9 ms against 0.1 for a batch of
# moe-gpu-2b behind queued work, one H200: benchmarks/results/host-waits-moe-2b-h200.json). A module setting
# so benchmarks/mfu.py can measure the difference (variant `pageable-batches`).
PIN_BATCHES = True


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    status: str  # "completed", or the kind of anomaly that stopped the run


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def prepare_data(cfg: Config, env: DistEnv) -> list[Component]:
    """Rank 0 writes (or finds) the shards of every data component (a mixture's, or the one
    corpus "data"); the others wait and read the same indexes."""
    urls: list = [None]
    if env.rank == 0:
        urls[0] = [index.url for index in shard_components(cfg.data, cfg.seq_len, cfg.model.vocab_size)]
    if env.world_size > 1:
        dist.broadcast_object_list(urls, src=0)
    return [Component(c.name, load_index(url), c.weight) for c, url in zip(cfg.data.components(), urls[0])]


def check_tokenizer_of_base_model(init_from: str | None, index: ShardIndex) -> None:
    """``checkpoint.init_from: hf:<dir>`` learned the ids of its own tokenizer: data written with
    another one would feed it other text under the same ids."""
    if not init_from or not init_from.startswith("hf:"):
        return
    path = Path(init_from[3:]) / "tokenizer.json"
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() != index.tokenizer_sha256:
        raise ConfigError(
            f"checkpoint.init_from {init_from}: its tokenizer ({path}, sha256 "
            f"{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}...) is not the data's ({index.tokenizer_url}, sha256 "
            f"{index.tokenizer_sha256[:16]}...): set data.tokenizer={init_from[3:]} so the shards use the model's own ids"
        )


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, startup: StartupTimer | None = None):
        self.cfg, self.env = cfg, env
        check_precision_supported(cfg, env.device)  # e.g. fp8 on a CPU: fail before anything is built
        self.startup = startup or StartupTimer(env.rank)  # times each start-up phase below
        with self.startup.phase("layout_groups"):
            self.groups = self._build_layout()
            # the layout as ZeRO, the gradient reduction and the checkpoint see it: dp x cp replicas
            self.replicas = self.groups.replicas()
        # Beating from the start: sharding, compiling and restoring show as phase "init".
        self.heartbeat = HeartbeatWriter(
            make_sink(cfg.reliability, cfg.train.run_dir, cfg.run_id), env.rank,
            interval_s=cfg.reliability.heartbeat_interval_s, stacks_dir=Path(cfg.train.run_dir) / "stacks",
            dp_rank=self.groups.dp_rank, tp_rank=self.groups.tp_rank, pp_rank=self.groups.pp_rank,
        )
        self.startup.on_phase(self.heartbeat.set_init_phase)
        self.grad_accumulation = cfg.train.grad_accumulation_steps(self.groups.dims.dp)
        seed_everything(cfg.train.seed)  # same initial weights on every rank

        with self.startup.phase("data_index"):
            self.components = prepare_data(cfg, env)
            # the run record and the tokenizer: the heaviest component's index (a mixture's
            # components share one tokenizer, which Mixture checks); evaluation reads every component
            self.index = max(self.components, key=lambda c: c.weight).index
            check_tokenizer_of_base_model(cfg.checkpoint.init_from, self.index)
            self.loader = self._build_loader()

        with self.startup.phase("model"):  # on the meta device first for large recipes
            # a DeepSpeed PipelineModule when pp > 1; checkpoint.init_from hf:<dir> loads here
            model, self.n_params = build_parallel_model(cfg, self.groups, env.device,
                                                        init_weights=hf_weights(cfg.checkpoint.init_from))
        with self.startup.phase("engine"):
            self.engine = self._build_engine(model)
        if cfg.model.attention_mask == "document":  # document ids from the data's EOS (a PipelineModule: its first stage's inputs)
            self.engine.module.eos_id = self.index.eos_id
        set_aux_loss_scale(model, 1.0 / self.grad_accumulation)  # MoE penalties scaled as DeepSpeed scales the loss
        self.fp8_guard = FP8Guard(model, cfg.train.precision == "fp8", env.device,
                                  cfg.reliability.anomaly.fp8_check_interval, self.replicas.dp_group)
        self.batches = self._device_batches()

        # the router checks need every MoE layer's shares on every rank: a pipeline stage sees only its own
        moe_checked = cfg.model.mlp == "moe" and self.groups.dims.pp == 1
        self.anomaly = AnomalyDetector(cfg.reliability.anomaly, cfg.model.moe.top_k if moe_checked else None,
                                       lr_warmup_steps=cfg.optim.warmup_steps)  # before restore: it has windows
        self.step = 0
        with self.startup.phase("checkpoint_restore"):
            self.checkpointer = Checkpointer(cfg, env, self.replicas, tokenizer_sha256=self.index.tokenizer_sha256)
            self.step = self.checkpointer.restore(self)  # 0 when there is nothing to resume from
        self._apply_rollbacks()
        self.tokens_per_step = cfg.train.global_batch_size * cfg.seq_len
        self.timers = StepTimers(env.device)
        peak = peak_flops(torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu")
        inactive = expected_parameter_count(cfg.model) - active_parameter_count(cfg.model)  # MoE: experts a token skips
        self.flops_per_token = flops_per_token(cfg.model.model_copy(update={"seq_len": cfg.seq_len}), self.n_params - inactive)
        self.peak_flops = peak * env.world_size if peak else None
        sinks = build_sinks(cfg.train, cfg.run_id, cfg.model_dump(mode="json"), first_step=self.step + 1) \
            if env.rank == 0 else []
        self.metrics = MetricsLogger(cfg.train.run_dir, cfg.train.steps, cfg.train.log_interval, enabled=env.rank == 0,
                                     sinks=sinks)
        self.evaluator = Evaluator(cfg, self.components, self.groups, env.device, self.grad_accumulation)
        if env.rank == 0:  # what export, generate and eval need to rebuild the model from a checkpoint
            write_run_record(cfg, self.index)
        self.heartbeat.beat(step=self.step, phase="data")
        self.faults = FaultInjector.from_config(cfg.reliability, env.rank, cfg.train.run_dir, model=self.engine.module,
                                                staging_dir=cfg.checkpoint.staging_dir)
        self.stragglers = StragglerMonitor(env.world_size)
        log.info("model: %.1fM parameters, %s block, %s attention; layout dp=%d cp=%d tp=%d pp=%d; accumulation %d",
                 self.n_params / 1e6, cfg.model.block, cfg.model.attention, self.groups.dims.dp, self.groups.dims.cp,
                 self.groups.dims.tp, self.groups.dims.pp, self.grad_accumulation)

    def _build_loader(self):
        """One reader per rank, or (parallel.node_loader) one per node serving its local ranks
        from shared memory; ranks of one tensor-parallel group pass the same dp_rank. A mixture
        under ``data.on_exhausted: stop`` that the run would exhaust is refused here, before a step."""
        cfg = self.cfg
        source = self.index
        if cfg.data.mixture is not None:
            source = Mixture(self.components, exhausted=cfg.data.on_exhausted)
            if cfg.data.on_exhausted == "stop":
                check_supply(self.components, cfg.train.steps * cfg.train.global_batch_size, seed=cfg.data.seed,
                             start=cfg.data.cursors, shuffle_shards=cfg.data.shuffle_shards)
        common = dict(
            micro_batch_size=cfg.train.micro_batch_size, dp_rank=self.groups.dp_rank, dp_size=self.groups.dims.dp,
            seed=cfg.data.seed, prefetch_batches=cfg.data.prefetch_batches, on_bad_shard=cfg.data.on_bad_shard,
            verify_checksums=cfg.data.verify_checksums, shuffle_shards=cfg.data.shuffle_shards,
            vocab_size=cfg.model.vocab_size, rank=self.env.rank,  # token ids are checked where they enter
            start=cfg.data.cursors,  # a campaign's later stage: each component goes on where the last one left it
        )
        if cfg.parallel.node_loader and self.env.local_world_size > 1:
            from megatrain.data.node_loader import build_node_loader

            return build_node_loader(source, local_rank=self.env.local_rank,
                                     local_world_size=self.env.local_world_size, **common)
        return build_loader(source, pin_device=self.env.device if PIN_BATCHES else None, **common)

    def _build_layout(self) -> ProcessGroups:
        p = self.cfg.parallel
        dims = ParallelDims(dp=p.data_parallel_size(self.env.world_size), tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)
        dims.validate(self.env.world_size, p.gpus_per_node, self.cfg.model.n_head, self.cfg.model.n_layer)
        if self.cfg.model.mlp == "moe" and p.tp > 1:
            raise ConfigError(f"model.mlp=moe: not yet with parallel.tp={p.tp} > 1 (the experts have no "
                              "tensor-parallel form); use tp 1 and parallel.ep to spread the experts")
        return build_process_groups(dims, self.env.rank, p.init.groups)

    def _build_engine(self, model: torch.nn.Module):
        cfg = self.cfg
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and self.env.device.type == "cuda")
        ds_config = deepspeed_config(cfg, self.groups.dims.dp, bf16, self.n_params)
        # A PipelineModule brings its own topology (built in our rank order), so no mpu then.
        mpu = None if self.groups.dims.pp > 1 else DeepSpeedMPU(self.replicas)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=mpu,
            dist_init_required=False,
        )
        try:
            check_checkpointable(engine.optimizer)
        except NotImplementedError as exc:
            raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} with train.dtype "
                              f"{'bf16' if bf16 else 'fp32'}: {exc}; use parallel.zero_stage=1 (on one GPU it "
                              "partitions nothing and costs the same, configs/gpt-1.3b.yaml)") from None
        attach_foreach_norms(engine.optimizer)  # ZeRO-1/2: one kernel per group for the norm and the inf/NaN check
        attach_fast_step(engine.optimizer)  # ZeRO-1/2: fp32 gradients copied once, the clip inside the fused AdamW
        if self.groups.dims.ep > 1:  # experts' gradients over their EDP group, exact clipping (ZeRO-0)
            attach_expert_grad_sync(engine.optimizer, engine.module, self.groups, cfg.optim.grad_clip)
        if isinstance(optimizer, Lamb) and cfg.parallel.zero_stage in (1, 2):
            # norms summed over the stage's TP x DP ranks: a TP-sharded tensor's norm is the whole tensor's
            attach_lamb_segments(engine.optimizer, optimizer, self.replicas.dp_group, norm_group=self.replicas.stage_group)
        return engine

    def _device_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The loader's (inputs, targets) micro-batches on this rank's device."""
        while True:
            inputs, targets = next(self.loader)  # pinned on a GPU (the node loader's are shared memory)
            yield inputs.to(self.env.device, non_blocking=True), targets.to(self.env.device, non_blocking=True)

    def _apply_rollbacks(self) -> None:
        """After an anomaly the orchestrator restored us to an earlier step: skip the window."""
        for record in pending_for(self.cfg.train.run_dir, self.step):
            log.warning("rollback to step %d after %s at step %d: skipping %d samples, lr x%g",
                        record.restore_step, record.kind, record.anomaly_step, record.skip_samples, record.lr_scale)
            self.loader.skip(record.skip_samples)
            scheduler = self.engine.lr_scheduler
            scheduler.base_lrs = [lr * record.lr_scale for lr in scheduler.base_lrs]
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr * record.lr_scale

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the step and tell the heartbeat which phase this rank is in. The
        profiler sees it as ``megatrain.<name>`` (``benchmarks/mfu_profile.py`` splits kernels by it)."""
        self.heartbeat.beat(phase="collective" if name == "comm" else name)
        with self.timers.phase(name), record_function(f"megatrain.{name}"):
            yield

    def train_step(self) -> StepMetrics:
        """One optimizer step over the global batch; returns its metrics."""
        start = time.perf_counter()
        lr = self.engine.get_lr()[0]  # the LR this step uses: the scheduler moves on inside engine.step()
        with self.phase("forward"):  # an injected slowdown counts as this rank's own compute
            self.faults.on_step_start(self.step + 1)
        step_loss = self._pipeline_batch() if self.groups.dims.pp > 1 else self._accumulated_batch()
        moe = moe_end_step(self.engine.module, self.replicas.dp_group)  # aux-free biases; expert-load health
        self.step += 1
        step_time = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / step_time
        return StepMetrics(
            step=self.step, loss=step_loss.item(), lr=lr,
            grad_norm=float(self.engine.get_global_grad_norm() or 0.0), tokens=self.step * self.tokens_per_step,
            step_time_s=step_time, tokens_per_s=tokens_per_s,
            mfu=mfu(tokens_per_s, self.flops_per_token, self.peak_flops) if self.peak_flops else None,
            phases_ms=self.timers.end_step() or {},
            fp8=self.fp8_guard.stats() if self.fp8_guard.due(self.step) else None,
            data=self.loader.component_stats(),  # samples, tokens, epochs per data component
            moe=moe,
        )

    def _accumulated_batch(self) -> torch.Tensor:
        """grad_accumulation micro-batches of forward and backward, then the (ZeRO-partitioned,
        clipped) optimizer step. DeepSpeed divides each micro-batch loss by the accumulation count
        and only steps at the accumulation boundary. Returns the loss of the global batch."""
        micro_losses = []
        for _ in range(self.grad_accumulation):
            with self.phase("data"):
                inputs, targets = next(self.batches)
                inputs, targets, sequence, weight = self._context_chunks(inputs, targets)
            with self.phase("forward"):
                loss = self.engine(inputs, targets) if sequence is None else \
                    self.engine(inputs, targets, sequence=sequence) * weight
                loss = self.faults.transform_loss(self.step + 1, loss)
            with self.phase("backward"):
                self.engine.backward(loss)
            with self.phase("optimizer"):
                self.engine.step()
            micro_losses.append(loss.detach().float())
        step_loss = torch.stack(micro_losses).mean()
        if self.replicas.dims.dp > 1:  # the loss of the whole global batch (over dp and cp), for logging and anomalies
            with self.phase("comm"):
                dist.all_reduce(step_loss, group=self.replicas.dp_group)
            step_loss /= self.replicas.dims.dp
        return step_loss

    def _context_chunks(self, inputs: torch.Tensor, targets: torch.Tensor):
        """parallel.cp > 1: this cp rank's two chunks of the samples, the Sequence its attention layers
        read (global positions, document ids of the whole samples, the ring or all-to-all) and its
        loss weight (parallel/context_parallel.py). cp = 1: the samples as they are."""
        if self.groups.dims.cp == 1:
            return inputs, targets, None, 1.0
        return rank_chunks(inputs, targets, self.cfg, self.groups, self.index.eos_id)

    def _pipeline_micro_batch(self, batch: tuple[torch.Tensor, torch.Tensor]):
        """A micro-batch -> what the pipeline's stages take (``pipeline.stage_micro_batch``): this cp
        rank's two chunks of it, with the document ids under the document mask. DeepSpeed averages
        the chunks' mean losses over the replicas unweighted: exact while every target counts (the
        loader ignores none), checked here rather than assumed."""
        inputs, targets = batch
        staged, y = stage_micro_batch(inputs, targets, self.cfg, self.groups, self.index.eos_id)
        if self.groups.dims.cp > 1 and loss_weight(targets, y, self.groups.dims.cp) != 1.0:
            raise ValueError("parallel.cp with parallel.pp: a micro-batch with ignored targets would weigh the cp "
                             "ranks' losses unevenly; the pipeline averages them unweighted")
        return staged, y

    def _pipeline_batch(self) -> torch.Tensor:
        """1F1B: DeepSpeed pulls grad_accumulation micro-batches from self.batches (first and last
        stage only), interleaves their forwards and backwards across the stages, reduces
        gradients (DP, and the tied embedding between first and last stage) and steps. Its loss
        is already averaged over micro-batches and DP, and broadcast to every stage. An injected
        loss fault can only change the reported loss here: the backward runs inside DeepSpeed.
        Under cp the stages get this rank's chunks of each micro-batch (their positions and the ring
        are held by the layers, ``pipeline.hold_context_chunks``); under the document mask the ids
        travel with the activations."""
        plain = self.groups.dims.cp == 1 and self.cfg.model.attention_mask != "document"
        batches = self.batches if plain else map(self._pipeline_micro_batch, self.batches)
        with self.phase("pipeline"):
            loss = self.engine.train_batch(batches)
        return self.faults.transform_loss(self.step + 1, loss.detach().float())

    def train(self) -> TrainResult:
        start = time.perf_counter()
        metrics, verdict = None, None
        try:
            while self.step < self.cfg.train.steps:
                metrics = self.train_step()
                if self.evaluator.due(metrics.step):  # held-out loss: as long as it takes, never a stalled step
                    self.heartbeat.beat(phase="eval")
                    self.evaluator.after_step(self.engine, metrics)
                self.heartbeat.beat(phase="log")  # the sinks may wait on a disk or a server: not a stalled step
                metrics.startup = self.startup.first_step(metrics.step_time_s, self.cfg.train.run_dir, self.step)
                self.metrics.log(metrics)
                # forward time of the previous step (timers read one step late): a straggler's own
                # compute; its peers' extra time shows up as waiting inside backward's reductions
                flagged = self.stragglers.observe(self.step, metrics.phases_ms.get("forward", 0.0) / 1000)
                self.heartbeat.beat(step=self.step, loss=metrics.loss, tokens_per_s=metrics.tokens_per_s,
                                    straggler=self.env.rank in flagged)
                verdict = self.anomaly.observe(self.step, metrics.loss, metrics.grad_norm, metrics.fp8, metrics.moe)
                if verdict is not None:  # stop before this step's state can be checkpointed
                    self._stop_on_anomaly(verdict)
                    break
                with self.phase("checkpoint"):
                    self.checkpointer.maybe_save(self)
        finally:
            self.checkpointer.close()  # waits for staging; uploads still running are finished too
            self.heartbeat.close(phase="done" if verdict is None and self.step >= self.cfg.train.steps else None)
            self.metrics.close()
            self.loader.close()
            if self.env.rank == 0:
                self.stragglers.save(self.cfg.train.run_dir)
        return TrainResult(
            steps=self.step, final_loss=metrics.loss if metrics else float("nan"),
            tokens=self.step * self.tokens_per_step, wall_s=time.perf_counter() - start,
            status="completed" if verdict is None else verdict.kind,
        )

    def _stop_on_anomaly(self, verdict: Verdict) -> None:
        """Every rank sees the same all-reduced loss, so every rank reaches the same verdict."""
        log.error("anomaly at step %d: %s", verdict.step, verdict.message)
        if self.env.rank == 0:
            write_verdict(self.cfg.train.run_dir, verdict)
