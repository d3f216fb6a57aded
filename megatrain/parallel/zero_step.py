"""ZeRO-1/2's optimizer step without its two fp32 passes over the gradients.

At the accumulation boundary DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``, stages 1
and 2, no offload) hands the inner optimizer an fp32 copy of this rank's gradient partition. It
makes it in three passes: the bf16 gradients are concatenated into one bf16 buffer, that buffer
is converted into an fp32 one, and the fp32 one is multiplied in place by 1 / (clip factor).
Only then does the fused AdamW read it. On moe-gpu-2b (2.17B parameters, one H200; the profile
of ``benchmarks/mfu.py --only kernels``) those passes took 2.3, 7.1 and 6.7 ms of a 45-ms
optimizer phase. The conversion is slow for a reason of its own: a tensor of more than 2^31
elements makes TensorIterator split it for 32-bit indexing, and the split copy runs unvectorised
(1.8 TB/s where a copy runs at 4).

``attach_fast_step(optimizer)`` changes two of its methods on the instance:

- the gradient partition is copied into the fp32 buffer directly, tensor by tensor, converting as
  it goes (one ``torch._foreach_copy_``); no bf16 buffer in between;
- the clip factor, a device tensor as in DeepSpeed (no host sync), becomes the fused AdamW's
  ``grad_scale``: the kernel divides each gradient by it as it reads it, so the gradients are not
  rewritten first. This is how ``torch.amp.GradScaler`` unscales for fused optimizers.

The numbers stay DeepSpeed's: the copy is exact, and g / c in place of g * (1 / c) differs by at
most one rounding. The two methods are DeepSpeed internals: attaching checks that they exist.
Other inner optimizers (LAMB, the foreach AdamW on CPU) keep DeepSpeed's own clip pass; the copy
applies to them too.
"""

from __future__ import annotations

import types

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.utils import is_invalid_grad_norm

ENABLED = True  # benchmarks/mfu.py --variants ds-step measures DeepSpeed's own
METHODS = ("flatten", "flatten_dense_tensors_aligned", "unscale_and_clip_grads", "averaged_gradients", "optimizer")


def fp32_flat_copy(tensors: list[torch.Tensor], alignment: int | None = None) -> torch.Tensor:
    """The tensors concatenated into one new fp32 vector, zero-padded to a multiple of ``alignment``
    (DeepSpeed's ``flatten_dense_tensors_aligned`` layout), converted on the way in."""
    numel = sum(t.numel() for t in tensors)
    padded = numel if not alignment else -(-numel // alignment) * alignment
    flat = torch.empty(padded, dtype=torch.float32, device=tensors[0].device)
    views, offset = [], 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    torch._foreach_copy_(views, list(tensors))
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


def _clip_in_adam(self, grad_groups_flat, total_norm):
    """DeepSpeed's ``unscale_and_clip_grads``, handed to the fused AdamW as its ``grad_scale``."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        self.optimizer.grad_scale = None
        return
    combined_scale = torch.tensor(float(self.loss_scale), dtype=torch.float32, device=grad_groups_flat[0].device)
    if self.clip_grad > 0.0:
        clip_norm = total_norm
        if is_invalid_grad_norm(clip_norm):  # DeepSpeed's guard for direct callers
            clip_norm = torch.tensor(float("inf"), dtype=torch.float32, device=self.device)
        clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
        combined_scale = (clip * self.loss_scale).to(torch.float32)
    self.optimizer.grad_scale = combined_scale.reshape(())


def _fused_adam(optimizer) -> bool:
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            and all(group.get("fused") for group in optimizer.param_groups))


def attach_fast_step(optimizer) -> bool:
    """Give a DeepSpeed ZeRO-1/2 optimizer the direct fp32 copy and, under a fused Adam(W), the clip
    inside the update; returns whether it was one (others, and CPU offload, are left alone)."""
    if not ENABLED or not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    missing = [name for name in METHODS if not hasattr(optimizer, name)]
    if missing:
        raise RuntimeError(f"this DeepSpeed's ZeRO optimizer has no {', '.join(missing)}: megatrain's step "
                           "(megatrain/parallel/zero_step.py) follows DeepSpeed 0.19's internals")
    if not _fp32_masters(optimizer):
        return False
    flatten = optimizer.flatten  # an attribute holding a function (torch's _flatten_dense_tensors)
    optimizer.flatten = lambda tensors: fp32_flat_copy(tensors) if _is_grad_partition(optimizer, tensors) else flatten(tensors)
    optimizer.flatten_dense_tensors_aligned = types.MethodType(_flatten_aligned, optimizer)
    if _fused_adam(optimizer.optimizer):
        optimizer.unscale_and_clip_grads = types.MethodType(_clip_in_adam, optimizer)
    return True
