"""DeepSpeed from megatrain's config: one function builds its config dict, one object hands it
our process groups (DeepSpeed's ``mpu`` protocol), one function restores LAMB's per-tensor trust
ratio under ZeRO's flat partitions."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.config import Config
from megatrain.optim.lamb import Lamb, TensorSegments
from megatrain.parallel.dims import ProcessGroups


def deepspeed_config(cfg: Config, dp: int, bf16: bool, n_params: int) -> dict:
    """The DeepSpeed config for this run. Bucket sizes follow the model: about 1/8 of the
    parameters per bucket (at least 5M, at most 500M elements) so the reduce-scatter of the first
    buckets overlaps the rest of the backward pass without too many small collectives."""
    bucket = int(min(5e8, max(5e6, n_params // 8)))
    bucket -= bucket % 2  # DeepSpeed wants 4-byte aligned buckets
    overlap = cfg.parallel.overlap
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accumulation_steps(dp),
        "train_batch_size": cfg.train.global_batch_size,
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "overlap_comm": overlap.dp_overlap_comm,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "round_robin_gradients": False,  # keeps the flat layout in model order (see attach_lamb_segments)
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


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


def attach_lamb_segments(zero_optimizer, lamb: Lamb, dp_group: dist.ProcessGroup | None) -> None:
    """Tell LAMB which model tensor each element of its flat ZeRO partition belongs to.

    ZeRO stage 1/2 flattens each parameter group (with alignment padding) and gives this rank one
    contiguous partition of it as a single parameter. Padding elements map to an extra segment id
    whose norms are never used (weights and updates there are zero).
    """
    partition_id = dist.get_rank(group=dp_group) if dp_group is not None else 0
    for i, flat_param in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        tensors = zero_optimizer.round_robin_bit16_groups[i]
        offsets = zero_optimizer.round_robin_bit16_offsets[i]
        partitions = zero_optimizer.parallel_partitioned_bit16_groups[i]
        start = sum(p.numel() for p in partitions[:partition_id])
        positions = torch.arange(start, start + flat_param.numel(), device=flat_param.device)
        ids = torch.full_like(positions, len(tensors))  # padding
        for tensor_id, (tensor, offset) in enumerate(zip(tensors, offsets)):
            inside = (positions >= offset) & (positions < offset + tensor.numel())
            ids[inside] = tensor_id
        lamb.set_tensor_segments(flat_param, TensorSegments(ids=ids, num_tensors=len(tensors) + 1, group=dp_group))
