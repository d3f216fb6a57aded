"""ZeRO-1/2's gradient norm and overflow check as multi-tensor kernels.

At every optimizer step DeepSpeed's ZeRO optimizer (``DeepSpeedZeroOptimizer``, stages 1 and 2)
checks the gradients for inf/NaN and then takes their norm for clipping, both one tensor at a time:
a max and a min reduction per tensor, then per tensor an fp64 copy and its norm, several launches
per tensor that the GPU waits for: the overflow check ends in a host sync, so the launches that
follow start from an empty queue. On moe-gpu-2b (2.17B parameters, an H200, its global batch at
micro-batch 32) the optimizer phase takes 45 ms a step with these, 74 ms with DeepSpeed's own
(``benchmarks/mfu.py --variants ds-norms``): 172,418 against 171,824 tokens/s.

``attach_foreach_norms(optimizer)`` replaces the two methods on the instance with
``torch._foreach_norm`` over the whole list: one multi-tensor kernel per group, summing in
DeepSpeed's norm precision (fp64 where the device has it). Summed in fp32 the norms differ from
DeepSpeed's by about 1e-6 relative, which a run resumed in another ZeRO stage showed against its
reference (tests/megatrain/checkpoint/test_reshard.py). The timings above were taken with fp32 sums;
fp64 adds about 4 GFLOP of fp64 arithmetic a step to a kernel bound by reading the 4.3 GB of bf16
gradients (estimated at a fraction of a millisecond on an H200, not measured).

- the norm keeps DeepSpeed's filters (alignment padding, pipeline-replicated parameters, model-
  parallel rank 0 for replicated tensors), its sums over the data- and model-parallel groups, and
  its -1 for a norm that is not finite;
- the overflow check is the same question, any inf or NaN in a gradient, answered by the
  gradients' 2-norms (NaN and inf propagate through the squares' sum);
- the norm that follows the overflow check in DeepSpeed's step reuses the check's per-tensor norms:
  one read of the 4.3 GB of gradients a step instead of two (2 ms on moe-gpu-2b). A norm is reused
  only for the very tensor it was taken of, unchanged since (its ``_version``); the cache holds
  weak references, so it keeps no gradient alive.

The two methods are DeepSpeed internals: attaching checks that they exist and fails loudly if a
DeepSpeed upgrade renamed them.
"""

from __future__ import annotations

import types
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import get_norm_dtype

ENABLED = True  # benchmarks/mfu.py --variants ds-norms measures DeepSpeed's own
METHODS = ("get_grad_norm_direct", "has_overflow_partitioned_grads_serial", "_model_parallel_all_reduce")


def _norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeed's ``get_grad_norm_direct`` for the 2-norm (other norms: DeepSpeed's own)."""
    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    kept = []
    param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
    for g, p in zip(param_gradients, params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:  # counted on its first stage only
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            kept.append(g)
    if kept:
        total = torch.stack(_cached_norms(self, kept)).square().sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    # DeepSpeed's mask_nan_or_inf_with_val_inplace (an invalid norm becomes -1), without the -1
    # it copies from the host: that copy waited for the GPU's queue every step
    return torch.where(torch.isfinite(total), total.sqrt(), -1.0)


def _overflow(self):
    """DeepSpeed's ``has_overflow_partitioned_grads_serial``: a [1] bool tensor, True when a
    gradient holds an inf or a NaN."""
    grads = [g for i in range(len(self.bit16_groups)) for g in (self.averaged_gradients[i] or [])
             if g is not None and g.numel()]
    if not grads:
        return torch.zeros(1, dtype=torch.bool, device=self.device)
    norms = torch._foreach_norm([g.detach() for g in grads], 2.0, dtype=get_norm_dtype())
    self._megatrain_norms = {id(g): (weakref.ref(g), g._version, n) for g, n in zip(grads, norms)}
    total = torch.stack(norms).sum()  # no finite bf16 overflows it
    return (~torch.isfinite(total)).reshape(1)


def _cached_norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, from the overflow check's when it took that very tensor's, unchanged."""
    cache = getattr(self, "_megatrain_norms", {})
    hits = [cache.get(id(g)) for g in grads]
    if all(hit is not None and hit[0]() is g and hit[1] == g._version for hit, g in zip(hits, grads)):
        return [hit[2] for hit in hits]
    return list(torch._foreach_norm([g.detach() for g in grads], 2.0, dtype=get_norm_dtype()))


def patchable_zero(optimizer, methods: tuple[str, ...], module: str) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer without CPU offload, with the
    internals ``methods`` that ``module`` replaces or reads; a DeepSpeed that renamed one fails
    loudly instead of being patched around."""
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    missing = [name for name in methods if not hasattr(optimizer, name)]
    if missing:
        raise RuntimeError(f"this DeepSpeed's ZeRO optimizer has no {', '.join(missing)}: {module} follows "
                           "DeepSpeed 0.19's internals")
    return True


def attach_foreach_norms(optimizer) -> bool:
    """Give a DeepSpeed ZeRO-1/2 optimizer the multi-tensor norm and overflow check; returns whether
    it was one (other optimizers are left alone). CPU offload keeps DeepSpeed's own: its norms are
    computed on the host copies."""
    if not ENABLED or not patchable_zero(optimizer, METHODS, "megatrain/parallel/zero_norms.py"):
        return False
    optimizer.get_grad_norm_direct = types.MethodType(_norm_direct, optimizer)
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(_overflow, optimizer)
    return True
