"""FP8 health of the converted weights, for the metrics and the anomaly detector.

Dynamic scaling cannot overflow a finite tensor (its scale is 448 / amax), so what goes wrong
in FP8 training shows as (a) a non-finite amax (an inf/NaN weight: every scale and GEMM of that
linear is garbage from then on) or (b) underflow: one outlier weight drives the tensor's amax so
high that the bulk of its values fall below e4m3's smallest subnormal (2^-9) once scaled, and
the GEMM sees zeros. ``FP8Guard.stats()`` measures both over every converted linear the way the
forward cast sees the weight (tensorwise scale from the whole tensor's amax), after the step:

    fp8_amax_max / fp8_amax_min   largest / smallest weight amax over the converted linears
    fp8_nonfinite                 linears whose amax is inf or NaN
    fp8_underflow                 fraction of the non-zero weights a tensorwise e4m3 cast flushes to 0

The activations and output gradients are cast inside the compiled blocks and are not inspected
here: a non-finite one shows up as a NaN loss or gradient norm, which the detector already
catches. Under ZeRO-3 each rank holds a partition of every weight: the per-tensor amaxes are
all-reduced (max) over the data-parallel group first, the counts summed after; with a pipeline,
the stages' statistics are combined over the whole world so every rank reaches the same verdict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
AMAX_EPS = 1e-12  # torchao's floor on amax before 448 / amax


def _local_weight(linear: nn.Module) -> tuple[torch.Tensor, bool]:
    """The weight this rank holds, and whether it is a ZeRO-3 partition of it."""
    weight = linear.weight
    partition = getattr(weight, "ds_tensor", None)
    return (partition, True) if partition is not None else (weight.detach(), False)


class FP8Guard:
    """Health statistics of the converted linears' weights, every ``interval`` steps.

    ``enabled`` comes from the config, not from this rank's modules: a pipeline stage whose
    blocks all stay in bf16 still joins the collectives of ``stats()``."""

    def __init__(self, model: nn.Module, enabled: bool, device: torch.device, interval: int = 1,
                 dp_group: dist.ProcessGroup | None = None):
        self.linears = []
        if enabled:
            from megatrain.precision.fp8 import fp8_linears

            self.linears = [m for _, m in fp8_linears(model)]
        self.enabled, self.device, self.interval, self.dp_group = enabled, device, interval, dp_group

    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    @torch.no_grad()
    def stats(self) -> dict[str, float]:
        weights = [_local_weight(m) for m in self.linears]
        amax = torch.zeros(len(weights), device=self.device)
        if weights:  # max |w| of every tensor in one multi-tensor launch (an empty partition's stays 0)
            held = [i for i, (w, _) in enumerate(weights) if w.numel()]
            norms = torch._foreach_norm([weights[i][0] for i in held], float("inf"))
            amax[held] = torch.stack(norms).float()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and any(partitioned for _, partitioned in weights):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.dp_group)
        scales = E4M3_MAX / amax.clamp(min=AMAX_EPS)
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # [flushed to zero, non-zero]
        for (w, _), scale in zip(weights, scales):
            nonzero = w != 0
            flushed = (w.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() == 0
            counts[0] += (flushed & nonzero).sum()
            counts[1] += nonzero.sum()
        # [max amax, -min amax, non-finite amaxes]; -inf / 0 where this rank holds no converted linear
        extremes = torch.tensor([-float("inf"), -float("inf"), 0.0], dtype=torch.float64, device=self.device)
        if len(weights):
            extremes = torch.stack([amax.max(), -amax.min(), (~torch.isfinite(amax)).sum().float()]).double()
        if distributed:  # pipeline stages / ZeRO-3 partitions: one answer on every rank
            dist.all_reduce(counts)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        flushed, nonzero = counts.tolist()
        amax_max, neg_amax_min, nonfinite = extremes.tolist()
        return {"fp8_amax_max": amax_max, "fp8_amax_min": -neg_amax_min, "fp8_nonfinite": nonfinite,
                "fp8_underflow": flushed / nonzero if nonzero else 0.0}
