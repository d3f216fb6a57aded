"""The trainer: builds the parts of a run in order, then steps them.

Build order: layout and process groups -> data -> model -> parallelize -> optimizer and schedule
-> DeepSpeed engine -> checkpointer (restores if a checkpoint exists) -> observers. Each observer
(metrics, checkpointer, heartbeats, anomaly detector) decides itself when to act; the loop only
calls them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist

from megatrain.config import Config
from megatrain.data.loader import build_loader
from megatrain.data.shard import ShardIndex, load_index, shard_corpus
from megatrain.model import GPT, count_parameters
from megatrain.observe.metrics import MetricsLogger, StepMetrics
from megatrain.observe.mfu import flops_per_token, mfu, peak_flops
from megatrain.observe.timers import StepTimers
from megatrain.optim import Lamb, build_optimizer, build_scheduler
from megatrain.parallel.deepspeed import DeepSpeedMPU, attach_lamb_segments, deepspeed_config
from megatrain.parallel.dims import ParallelDims, ProcessGroups, build_process_groups
from megatrain.parallel.init import DistEnv
from megatrain.parallel.parallelize import parallelize

log = logging.getLogger("megatrain")


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    status: str  # "completed", or the kind of anomaly that stopped the run


def prepare_data(cfg: Config, env: DistEnv) -> ShardIndex:
    """Rank 0 writes (or finds) the shards; the others wait and read the same index."""
    url = [None]
    if env.rank == 0:
        url[0] = shard_corpus(cfg.data, cfg.model.seq_len, cfg.model.vocab_size).url
    if env.world_size > 1:
        dist.broadcast_object_list(url, src=0)
    return load_index(url[0])


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.groups = self._build_layout()
        self.grad_accumulation = cfg.train.grad_accumulation_steps(self.groups.dims.dp)
        torch.manual_seed(cfg.train.seed)  # same initial weights on every rank

        self.index = prepare_data(cfg, env)
        self.loader = build_loader(
            self.index, micro_batch_size=cfg.train.micro_batch_size, dp_rank=self.groups.dp_rank,
            dp_size=self.groups.dims.dp, seed=cfg.data.seed, prefetch_batches=cfg.data.prefetch_batches,
            on_bad_shard=cfg.data.on_bad_shard, verify_checksums=cfg.data.verify_checksums,
        )

        model = GPT(cfg.model).to(env.device)
        self.n_params = count_parameters(model)
        model = parallelize(model, cfg, self.groups)
        self.engine = self._build_engine(model)

        self.step = 0
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.timers = StepTimers(env.device)
        peak = peak_flops(torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu")
        self.flops_per_token = flops_per_token(cfg.model, self.n_params)
        self.peak_flops = peak * env.world_size if peak else None
        self.metrics = MetricsLogger(cfg.train.run_dir, cfg.train.steps, cfg.train.log_interval, enabled=env.rank == 0)
        log.info("model: %.1fM parameters, %s block, %s attention; layout dp=%d tp=%d pp=%d; accumulation %d",
                 self.n_params / 1e6, cfg.model.block, cfg.model.attention, self.groups.dims.dp,
                 self.groups.dims.tp, self.groups.dims.pp, self.grad_accumulation)

    def _build_layout(self) -> ProcessGroups:
        p = self.cfg.parallel
        dims = ParallelDims(dp=p.data_parallel_size(self.env.world_size), tp=p.tp, pp=p.pp)
        dims.validate(self.env.world_size, p.gpus_per_node, self.cfg.model.n_head, self.cfg.model.n_layer)
        return build_process_groups(dims, self.env.rank)

    def _build_engine(self, model: torch.nn.Module):
        cfg = self.cfg
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and self.env.device.type == "cuda")
        ds_config = deepspeed_config(cfg, self.groups.dims.dp, bf16, self.n_params)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
            mpu=DeepSpeedMPU(self.groups), dist_init_required=False,
        )
        if isinstance(optimizer, Lamb) and cfg.parallel.zero_stage in (1, 2):
            attach_lamb_segments(engine.optimizer, optimizer, self.groups.dp_group)
        return engine

    def train_step(self) -> StepMetrics:
        """One optimizer step: grad_accumulation micro-batches of forward and backward, then the
        (ZeRO-partitioned, clipped) optimizer step. DeepSpeed divides each micro-batch loss by the
        accumulation count and only steps at the accumulation boundary."""
        start = time.perf_counter()
        micro_losses = []
        for _ in range(self.grad_accumulation):
            with self.timers.phase("data"):
                inputs, targets = next(self.loader)
                inputs = inputs.to(self.env.device, non_blocking=True)
                targets = targets.to(self.env.device, non_blocking=True)
            with self.timers.phase("forward"):
                loss = self.engine(inputs, targets)
            with self.timers.phase("backward"):
                self.engine.backward(loss)
            with self.timers.phase("optimizer"):
                self.engine.step()
            micro_losses.append(loss.detach().float())
        self.step += 1

        step_loss = torch.stack(micro_losses).mean()
        if self.groups.dims.dp > 1:  # the loss of the whole global batch, for logging and anomalies
            dist.all_reduce(step_loss, group=self.groups.dp_group)
            step_loss /= self.groups.dims.dp
        step_time = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / step_time
        return StepMetrics(
            step=self.step, loss=step_loss.item(), lr=self.engine.get_lr()[0],
            grad_norm=float(self.engine.get_global_grad_norm() or 0.0), tokens=self.step * self.tokens_per_step,
            step_time_s=step_time, tokens_per_s=tokens_per_s,
            mfu=mfu(tokens_per_s, self.flops_per_token, self.peak_flops) if self.peak_flops else None,
            phases_ms=self.timers.end_step(),
        )

    def train(self) -> TrainResult:
        start = time.perf_counter()
        metrics = None
        try:
            while self.step < self.cfg.train.steps:
                metrics = self.train_step()
                self.metrics.log(metrics)
        finally:
            self.metrics.close()
            self.loader.close()
        return TrainResult(
            steps=self.step, final_loss=metrics.loss if metrics else float("nan"),
            tokens=self.step * self.tokens_per_step, wall_s=time.perf_counter() - start, status="completed",
        )
