"""DeepSpeed from megatrain's config: one function builds its config dict, one object hands it
our process groups (DeepSpeed's ``mpu`` protocol; a pipeline engine takes a ``topology`` with the
same rank order instead), and one function keeps LAMB's trust ratio per model tensor when ZeRO
flattens the tensors (and tensor parallelism shards them)."""

from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatrain.config import Config
from megatrain.optim.lamb import Lamb, TensorSegments
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.overlap import zero_overlap_settings


# DeepSpeed's throughput timer (on by default) synchronises the device at the start of every
# micro-batch's forward and at the end of every ``engine.step()``, from the third optimizer step
# on: twice per micro-batch the GPU drains while the host prepares the next work. megatrain times
# its steps with CUDA events (``observe/timers.py``), so the timer is off. Measured on an H200
# (Llama-3.2-1B at its recipe's batch of 32 micro-batches of 16, benchmarks/mfu.py): 73,020
# tokens/s without it, 72,334 with it. A module setting so the benchmark can measure it.
THROUGHPUT_TIMER: dict = {"enabled": False}


def deepspeed_config(cfg: Config, dp: int, bf16: bool, n_params: int) -> dict:
    """The DeepSpeed config for this run. Bucket sizes follow the model: about 1/8 of the
    parameters per bucket (at least 5M, at most 500M elements) so the reduce-scatter of the first
    buckets overlaps the rest of the backward pass without too many small collectives.

    With pp > 1 the ``pipeline`` section is added (the engine is then a ``PipelineEngine``):
    ZeRO-2/3 cannot be combined with DeepSpeed's pipeline (it asserts), and DeepSpeed's
    activation partitioning between stages must stay off under sequence parallelism, where the
    TP ranks of a stage hold different sequence shards rather than copies of one activation."""
    p = cfg.parallel
    bucket = int(min(5e8, max(5e6, n_params // 8)))
    bucket -= bucket % 2  # DeepSpeed wants 4-byte aligned buckets
    config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accumulation_steps(dp),
        # ``dp`` is the data-parallel degree; DeepSpeed's data-parallel group is the dp x cp replica
        # group, whose cp ranks each run a micro-batch of the same samples: it counts them cp times
        "train_batch_size": cfg.train.global_batch_size * p.cp,
        # under expert parallelism megatrain clips by the exact global norm (expert_parallel.py)
        "gradient_clipping": cfg.optim.grad_clip if p.ep == 1 else 0.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": p.zero_stage,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "round_robin_gradients": False,  # keeps the flat layout in model order (see attach_lamb_segments)
            **zero_overlap_settings(p.overlap, p.zero_stage, bucket),
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "timers": {"throughput": dict(THROUGHPUT_TIMER)},
    }
    if p.tp > 1 and cfg.optim.name == "lamb" and p.zero_stage not in (1, 2):
        # LAMB's trust ratio needs whole-tensor norms; attach_lamb_segments provides them (summed over
        # the stage's TP x DP ranks) only for ZeRO-1/2's flat partitions.
        raise ValueError(f"parallel.tp={p.tp} with LAMB needs parallel.zero_stage 1 or 2, got {p.zero_stage}")
    if p.ep > 1 and bf16:
        # ZeRO-0 in bf16 is DeepSpeed's FP16_Optimizer: it clips and steps fp32 copies of its own,
        # past the hooks that reduce the experts' gradients over their EDP group (expert_parallel.py)
        raise ValueError(f"parallel.ep={p.ep} needs train.dtype=fp32: with bf16 weights DeepSpeed's ZeRO-0 optimizer "
                         "wrapper reduces and clips fp32 copies that megatrain's expert-gradient reduction cannot reach")
    if p.pp > 1 and bf16 and cfg.optim.name == "lamb" and p.zero_stage == 0:
        # DeepSpeed's pipeline engine wraps a bf16 ZeRO-0 optimizer in its BF16_Optimizer, which hands
        # LAMB one flat tensor per group: one trust ratio for the whole model, silently.
        raise ValueError("parallel.pp > 1 with LAMB in bf16 needs parallel.zero_stage 1 (DeepSpeed's BF16_Optimizer "
                         "would flatten the parameters and LAMB would compute one trust ratio for all of them)")
    if p.pp > 1:
        if p.zero_stage > 1:
            raise ValueError(f"parallel.zero_stage={p.zero_stage} with pp={p.pp}: DeepSpeed's pipeline supports ZeRO 0 or 1")
        partitioned = p.tp > 1 and not p.sequence_parallel
        config["pipeline"] = {
            "pipe_partitioned": partitioned,
            "grad_partitioned": partitioned,
            "activation_checkpoint_interval": 1 if cfg.model.activation_checkpointing.policy == "full" else 0,
        }
    return config


def pipeline_topology(dims: ParallelDims) -> PipeModelDataParallelTopology:
    """DeepSpeed's topology for our layout. Its axes (pipe, data, model) are row-major, so
    rank = pipe * dp * tp + data * tp + model: exactly ``ParallelDims.rank_of``."""
    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


class DeepSpeedMPU:
    """DeepSpeed's model-parallel-unit protocol over our ``ProcessGroups``."""

    def __init__(self, groups: ProcessGroups):
        self.groups = groups

    def get_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.dims.tp

    def get_model_parallel_group(self):
        return self.groups.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dims.dp

    def get_data_parallel_group(self):
        return self.groups.dp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.groups.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.groups.dims.pp

    def get_pipeline_model_parallel_group(self):
        return self.groups.pp_group


def attach_lamb_segments(
    zero_optimizer, lamb: Lamb, dp_group: dist.ProcessGroup | None, norm_group: dist.ProcessGroup | None = None
) -> None:
    """Tell LAMB which model tensor each element of its flat ZeRO partition belongs to.

    ZeRO stage 1/2 flattens each parameter group (with alignment padding) and gives this rank one
    contiguous partition of it as a single parameter. Padding elements belong to no span (weights
    and updates there are zero).

    ``norm_group`` is where the per-tensor squared norms are summed: the DP group by default; with
    tensor parallelism, the pipeline stage's TP x DP group (``ProcessGroups.stage_group``), so a
    sharded tensor's norm is that of the whole tensor. A replicated tensor is then counted t times
    in both ||w||^2 and ||u||^2, which leaves its ratio ||w|| / ||u|| unchanged.
    """
    partition_id = dist.get_rank(group=dp_group) if dp_group is not None else 0
    norm_group = dp_group if norm_group is None else norm_group
    for i, flat_param in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        tensors = zero_optimizer.round_robin_bit16_groups[i]
        offsets = zero_optimizer.round_robin_bit16_offsets[i]
        partitions = zero_optimizer.parallel_partitioned_bit16_groups[i]
        start = sum(p.numel() for p in partitions[:partition_id])
        end = start + flat_param.numel()
        spans = []  # each model tensor's overlap with [start, end), in partition coordinates
        for tensor_id, (tensor, offset) in enumerate(zip(tensors, offsets)):
            lo, hi = max(start, offset), min(end, offset + tensor.numel())
            if lo < hi:
                spans.append((lo - start, hi - lo, tensor_id))
        lamb.set_tensor_segments(flat_param, TensorSegments(spans=spans, num_tensors=len(tensors), group=norm_group))

