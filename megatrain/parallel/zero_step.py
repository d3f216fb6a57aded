"""ZeRO-1/2's optimizer step without its fp32 passes over the gradients.

At the accumulation boundary DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``, stages 1
and 2, no offload) hands the inner optimizer an fp32 copy of this rank's gradient partition. It
makes it in three passes: the bf16 gradients are concatenated into one bf16 buffer, that buffer
is converted into an fp32 one, and the fp32 one is multiplied in place by 1 / (clip factor).
Then the inner optimizer updates the fp32 master, and a last pass copies the master into the
bf16 weights. On moe-gpu-2b (2.17B parameters, one H200; ``benchmarks/mfu.py --only kernels``)
the three passes took 2.3, 7.1 and 6.7 ms, the fused AdamW 17.9 and the copy 3.0 of a 45-ms
optimizer phase. The conversion is slow for a reason of its own: a tensor of more than 2^31
elements makes TensorIterator split it for 32-bit indexing, and the split copy runs
unvectorised (1.8 TB/s where a copy runs at 4).

``attach_fast_step(optimizer)`` changes the instance:

- under torch's fused AdamW (what megatrain builds on a GPU), ``step`` is megatrain's: DeepSpeed's
  own control flow (overflow check, norm, loss scale, the skipped step, the all-gather) with the
  fp32 copy, the clip, AdamW and the bf16 copy as one pass, ``kernels/adamw_master.py``, which
  reads each bf16 gradient once and divides it by the clip factor as it goes. The optimizer
  state stays torch's AdamW state on the fp32 master (``exp_avg``, ``exp_avg_sq``, ``step``), so
  checkpoints do not change;
- for other inner optimizers (LAMB, the foreach AdamW on CPU) DeepSpeed's step stays, but the
  gradient partition is copied into its fp32 buffer directly, tensor by tensor, converting as it
  goes (one ``torch._foreach_copy_``): no bf16 buffer in between.

The numbers stay DeepSpeed's: the copy is exact, and the AdamW is torch's fused AdamW's formula
(g / c in place of g * (1 / c): one rounding apart). What it reads of DeepSpeed are internals:
attaching checks that they exist, and a step whose gradients are not a plain list of one dtype
takes DeepSpeed's own path.
"""

from __future__ import annotations

import types

import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import all_gather_dp_groups
from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

from megatrain.kernels.adamw_master import AdamWHyper, adamw_master_step, segments
from megatrain.parallel.zero_norms import patchable_zero

ENABLED = True  # benchmarks/mfu.py --variants ds-step measures DeepSpeed's own
ONE_RANK_IN_PLACE = True  # --variants ds-reduce: DeepSpeed's boundary reduction on one rank too
METHODS = ("flatten", "flatten_dense_tensors_aligned", "averaged_gradients", "optimizer",
           "has_overflow_partitioned_grads_serial", "_model_parallel_all_reduce", "dp_process_group",
           "check_grad_overflow", "compute_grad_norm", "scaled_global_norm", "_update_scale",
           "free_grad_in_param_list", "_release_preflattened_grad_buffers", "_get_preflattened_grad_partition",
           "_lazy_init_hp_params_optimizer_state", "_update_model_bit16_weights",
           "parallel_partitioned_bit16_groups", "single_partition_of_fp32_groups", "params_not_in_partition",
           "real_dp_process_group", "bit16_groups_flat", "reduce_ready_partitions_and_remove_grads",
           "params_already_reduced", "partition_gradients", "has_moe_layers")


def fp32_flat_copy(tensors: list[torch.Tensor], alignment: int | None = None) -> torch.Tensor:
    """The tensors concatenated into one new fp32 vector, zero-padded to a multiple of ``alignment``
    (DeepSpeed's ``flatten_dense_tensors_aligned`` layout), converted on the way in."""
    numel = sum(t.numel() for t in tensors)
    padded = numel if not alignment else -(-numel // alignment) * alignment
    flat = torch.empty(padded, dtype=torch.float32, device=tensors[0].device)
    torch._foreach_copy_([flat.narrow(0, start, t.numel()).view(t.shape) for start, t in segments(tensors)], list(tensors))
    flat.narrow(0, numel, padded - numel).zero_()
    return flat


def _is_grad_partition(optimizer, tensors) -> bool:
    """Whether ``tensors`` is one of the lists the step flattens for the inner optimizer."""
    return bool(tensors) and any(tensors is grads for grads in optimizer.averaged_gradients.values())


def _fp32_masters(optimizer) -> bool:
    return all(p.dtype == torch.float32 for p in optimizer.single_partition_of_fp32_groups)


def _flatten_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
    if not use_cpu_data and param_padding is None and _is_grad_partition(self, tensor_list):
        return fp32_flat_copy(tensor_list, int(alignment))
    return type(self).flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data, param_padding)


def _valid_norm(norm: torch.Tensor) -> torch.Tensor:
    """On the device, what ``deepspeed.runtime.utils.is_invalid_grad_norm`` negates on the host:
    finite and not the -1 an invalid norm is masked to."""
    return torch.isfinite(norm) & (norm >= 0)


def clip_divisor(optimizer, total_norm: torch.Tensor | None) -> torch.Tensor | None:
    """The factor DeepSpeed's ``unscale_and_clip_grads`` divides the gradients by (loss scale times
    the clip), as a device tensor; None when it would not touch them."""
    if optimizer.clip_grad == 0.0 and optimizer.loss_scale == 1.0:
        return None
    device = optimizer.single_partition_of_fp32_groups[0].device
    # made on the device (a fill): a tensor copied from the host would wait for the GPU's queue
    combined = torch.full((), float(optimizer.loss_scale), dtype=torch.float32, device=device)
    if optimizer.clip_grad > 0.0 and total_norm is not None:  # None: no norm was computed, none to clip by
        # DeepSpeed's guard (an invalid norm, NaN, inf or its -1, clips by inf), on the device: no host sync
        norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
        clip_norm = torch.where(_valid_norm(norm), norm, float("inf"))
        clip = torch.clamp(((clip_norm / optimizer.loss_scale) + 1e-6) / optimizer.clip_grad, min=1.0)
        combined = (clip * optimizer.loss_scale).to(torch.float32)
    return combined.reshape(())


def _fused_adamw(optimizer) -> bool:
    return type(optimizer) is torch.optim.AdamW and all(
        g.get("fused") and not g.get("amsgrad") and not g.get("maximize") and not g.get("differentiable")
        for g in optimizer.param_groups)


def _plain_gradients(self) -> bool:
    """Whether every group's gradient partition is a list of contiguous tensors of one dtype (and
    no pre-flattened buffer of DeepSpeed's compiler passes)."""
    for i in range(len(self.bit16_groups)):
        grads = self.averaged_gradients.get(i)
        if grads is None or self._get_preflattened_grad_partition(i) is not None:
            return False
        if len({g.dtype for g in grads}) > 1 or not all(g.is_contiguous() for g in grads):
            return False
    return True


def _adamw_state(optimizer: torch.optim.AdamW, master: torch.Tensor) -> dict:
    """torch's AdamW state of ``master``, made as torch's fused AdamW makes it on its first step."""
    state = optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    elif state["step"].device != master.device or state["step"].dtype != torch.float32:
        state["step"] = state["step"].to(master.device, torch.float32)  # e.g. a restored state's count
    return state


def _overflow_and_norm(self) -> tuple[bool, torch.Tensor | None]:
    """DeepSpeed's overflow check (inf or NaN in a gradient, over the data- and model-parallel
    ranks) and its scaled gradient norm (an invalid norm is an overflow as well), read by the host
    in one copy: DeepSpeed reads each as it is made, and each read waits for the GPU's queue to
    drain. The norm is computed on an overflowing step too (DeepSpeed skips it there; it reuses
    the check's per-tensor norms, and every rank computes it, so the collectives stay matched)."""
    flags = []
    if self.check_grad_overflow:  # DeepSpeed's has_overflow without its .item() (no CPU offload here)
        overflow = self.has_overflow_partitioned_grads_serial().byte()
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow, op=dist.ReduceOp.MAX)
        flags.append(overflow.reshape(()).bool())
    norm = self.scaled_global_norm() if self.compute_grad_norm else None
    if norm is not None and (self.dtype != torch.bfloat16 or self.check_grad_overflow):
        flags.append(~_valid_norm(norm))
    return (bool(torch.stack(flags).any()) if flags else False), norm


def _master_step(self, closure=None):
    """DeepSpeed's ``step`` (stage 1/2, no offload) with the update as one pass per group."""
    if not _plain_gradients(self):
        return type(self).step(self, closure)
    self.micro_step_id = INITIAL_MICRO_STEP_ID
    if not self.compute_grad_norm:
        self._global_grad_norm = None
    self.overflow, norm = _overflow_and_norm(self)
    prev_scale = self.loss_scale
    self._update_scale(self.overflow)
    if self.overflow:  # the step is skipped, its gradients dropped
        if self.compute_grad_norm:
            self._global_grad_norm = float("inf")
        self.zero_grad(set_to_none=True)
        self._release_preflattened_grad_buffers()
        for k in self.averaged_gradients.keys():
            self.averaged_gradients[k] = None
            self.all_grad_tensors[k] = None
        return
    if norm is not None:
        self._global_grad_norm = norm / prev_scale
    divisor = clip_divisor(self, norm)
    inner = self.optimizer
    for i in range(len(self.bit16_groups)):
        partition_id = dist.get_rank(group=self.real_dp_process_group[i])
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        master = self.single_partition_of_fp32_groups[i]
        group = inner.param_groups[i]
        state = _adamw_state(inner, master)
        state["step"] += 1
        hyper = AdamWHyper(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                           weight_decay=group["weight_decay"])
        adamw_master_step(master.data, state["exp_avg"], state["exp_avg_sq"],
                          self.parallel_partitioned_bit16_groups[i][partition_id].data,
                          self.averaged_gradients[i], state["step"], hyper, divisor)
        self.free_grad_in_param_list(self.params_in_partition[i])
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None
    self._lazy_init_hp_params_optimizer_state()
    all_gather_dp_groups(groups_flat=self.bit16_groups_flat, partitioned_param_groups=self.parallel_partitioned_bit16_groups,
                         dp_process_group=self.real_dp_process_group, start_alignment_factor=self.nccl_start_alignment_factor,
                         allgather_bucket_size=self.allgather_bucket_size)
    for i in range(len(self.bit16_groups)):
        self._update_model_bit16_weights(i)


def _keep_gradients_in_place(self, param, i):
    """ZeRO-1 on one data-parallel rank: the reduction DeepSpeed runs at the accumulation boundary
    reduces over one rank, so it only copies every gradient into a bucket and from there into its
    partition buffer (two copies of all gradients: 6.7 ms a step on moe-gpu-2b). The gradient is
    left where autograd accumulated it and only marked as reduced; the boundary's epilogue takes
    the partition's gradients from the parameters as it does from that buffer."""
    if self.is_gradient_accumulation_boundary():
        self.params_already_reduced[self.get_param_id(param)] = True


def _one_rank_stage1(optimizer) -> bool:
    return (not optimizer.partition_gradients and not optimizer.has_moe_layers and not optimizer.zenflow
            and all(dist.get_world_size(group=g) == 1 for g in optimizer.real_dp_process_group))


def attach_fast_step(optimizer) -> bool:
    """Give a DeepSpeed ZeRO-1/2 optimizer megatrain's step under a fused AdamW, else the direct fp32
    copy; returns whether it was one (others, and CPU offload, are left alone)."""
    if not ENABLED or not patchable_zero(optimizer, METHODS, "megatrain/parallel/zero_step.py"):
        return False
    if not _fp32_masters(optimizer):
        return False
    flatten = optimizer.flatten  # an attribute holding a function (torch's _flatten_dense_tensors)
    optimizer.flatten = lambda tensors: fp32_flat_copy(tensors) if _is_grad_partition(optimizer, tensors) else flatten(tensors)
    optimizer.flatten_dense_tensors_aligned = types.MethodType(_flatten_aligned, optimizer)
    if (_fused_adamw(optimizer.optimizer) and not optimizer.zenflow
            and getattr(optimizer, "torch_autocast_gradscaler", None) is None):
        optimizer.step = types.MethodType(_master_step, optimizer)
    if ONE_RANK_IN_PLACE and _one_rank_stage1(optimizer):
        optimizer.reduce_ready_partitions_and_remove_grads = types.MethodType(_keep_gradients_in_place, optimizer)
    return True
