"""LAMB (You et al., 2019): Adam moments, decoupled weight decay, and a per-tensor trust ratio.

For each tensor w with gradient g, at step t:
    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    trust = min(||w|| / ||u||, max_trust_ratio)   (1 when either norm is 0)
    w = w - lr * trust * u

Written with torch._foreach ops (one kernel launch per op for the whole group, not per tensor);
on CUDA the three-launch Triton kernel of ``megatrain/kernels/lamb_triton.py`` runs instead.

ZeRO hands the optimizer one flat partition per group instead of the model's tensors, which would
turn the per-tensor trust ratio into a per-partition one. ``set_tensor_segments`` restores the
per-tensor semantics: it tells LAMB where each model tensor lies inside the flat partition, and
the norms are summed per segment and all-reduced across the data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.kernels import triton_available


@dataclass
class TensorSegments:
    """Where model tensors lie inside one flat partition: ``spans`` are (start, length, tensor id)
    ranges of the partition; elements outside every span are padding (always zero)."""

    spans: list[tuple[int, int, int]]
    num_tensors: int
    group: dist.ProcessGroup | None  # where the partitions' squared norms are summed

    def __post_init__(self) -> None:
        self._ids: dict[torch.device, torch.Tensor] = {}

    def ids(self, device: torch.device) -> torch.Tensor:
        """The tensor id of each span, cached per device."""
        if device not in self._ids:
            self._ids[device] = torch.tensor([tensor_id for _, _, tensor_id in self.spans], device=device)
        return self._ids[device]

    def trust_ratios(self, span_sums: torch.Tensor, max_ratio: float) -> torch.Tensor:
        """Per-span trust ratios [spans] from per-span squared norms [spans, 2] (||w||^2, ||u||^2):
        summed per model tensor (a tensor may have several spans), then over ``group``, so every
        span of a tensor gets that whole tensor's ratio. Every rank of ``group`` must call this."""
        ids = self.ids(span_sums.device)
        sums = torch.zeros(self.num_tensors, 2, dtype=torch.float32, device=span_sums.device)
        sums.index_add_(0, ids, span_sums.float())
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        return _clipped_ratio(sums[:, 0].sqrt(), sums[:, 1].sqrt(), max_ratio)[ids]


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float = 10.0,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        self._segments: dict[int, TensorSegments] = {}  # id(param) -> segments

    def set_tensor_segments(self, param: torch.Tensor, segments: TensorSegments) -> None:
        self._segments[id(param)] = segments

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update_group(group, params)
        return loss

    def _update_group(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        for p in params:
            if not self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p]["exp_avg"] = torch.zeros_like(p)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1
        step = int(states[0]["step"].item())

        segmented = [id(p) in self._segments for p in params]
        if params[0].is_cuda and triton_available() and len(set(segmented)) == 1:
            from megatrain.kernels.lamb_triton import lamb_step_fused

            hyper = dict(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], max_trust_ratio=group["max_trust_ratio"])
            if segmented[0]:
                self._fused_over_spans(params, grads, exp_avgs, exp_avg_sqs, hyper)
            else:
                lamb_step_fused(params, grads, exp_avgs, exp_avg_sqs, **hyper)
            return

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2**0.5)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        torch._foreach_div_(updates, bias_correction1)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        trust = [self._trust_ratio(p, u, group["max_trust_ratio"]) for p, u in zip(params, updates)]
        torch._foreach_mul_(updates, trust)
        torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _fused_over_spans(self, params, grads, exp_avgs, exp_avg_sqs, hyper: dict) -> None:
        """ZeRO partitions on CUDA: the fused kernels run over every model tensor's span of each
        flat partition (views, no copies), and the spans' squared norms are combined into
        whole-tensor trust ratios (summed per model tensor, then over the segments' group). The
        foreach form below needs two partition-sized temporaries (12 GiB each for a 13B model
        over TP4) and about a dozen passes over them."""
        from megatrain.kernels.lamb_triton import lamb_step_fused

        views: tuple[list, list, list, list] = ([], [], [], [])
        owners = []  # (segments, index of its first span, number of spans) per partition
        for tensors in zip(params, grads, exp_avgs, exp_avg_sqs):
            segments = self._segments[id(tensors[0])]
            owners.append((segments, len(views[0]), len(segments.spans)))
            for start, length, _ in segments.spans:
                for lst, t in zip(views, tensors):
                    lst.append(t.narrow(0, start, length))
        max_ratio = hyper["max_trust_ratio"]

        def trust_from_sums(span_sums: torch.Tensor) -> torch.Tensor:  # [spans, 2] -> [spans]
            return torch.cat([segments.trust_ratios(span_sums[first:first + count], max_ratio)
                              for segments, first, count in owners])

        if not views[0]:  # only padding here: still take part in the other ranks' all-reduces
            trust_from_sums(torch.zeros(0, 2, device=params[0].device))
            return
        lamb_step_fused(*views, **hyper, trust_from_sums=trust_from_sums)

    def _trust_ratio(self, param: torch.Tensor, update: torch.Tensor, max_ratio: float) -> torch.Tensor:
        """||w|| / ||u|| clipped to max_ratio, per model tensor, as a 0-dim tensor. For a flat ZeRO
        partition holding several model tensors the per-tensor ratios are applied to ``update``'s
        spans in place here (one foreach norm and one all-reduce), and the result is 1."""
        segments = self._segments.get(id(param))
        if segments is None:
            return _clipped_ratio(param.norm(), update.norm(), max_ratio)
        w_views = [param.narrow(0, start, length) for start, length, _ in segments.spans]
        u_views = [update.narrow(0, start, length) for start, length, _ in segments.spans]
        span_sums = torch.stack([torch.stack(torch._foreach_norm(views)).float().square()
                                 for views in (w_views, u_views)], dim=1)  # [spans, 2]
        ratios = segments.trust_ratios(span_sums, max_ratio).to(update.dtype)
        torch._foreach_mul_(u_views, list(ratios.unbind()))
        return torch.ones((), dtype=update.dtype, device=update.device)


def _clipped_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, max_ratio: float) -> torch.Tensor:
    ratio = (w_norm / u_norm).clamp(max=max_ratio)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
