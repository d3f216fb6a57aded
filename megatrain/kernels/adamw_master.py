"""AdamW on fp32 master weights straight from 16-bit gradients, writing the 16-bit weights too.

Mixed-precision training keeps an fp32 copy of every weight (the master) with AdamW's two fp32
moments, and a bf16 copy the model computes with. One step per element, with c the clip factor
(gradient-norm clipping as a divisor, 1 when nothing is clipped) and t the step after its
increment, is torch's AdamW:

    g = grad / c
    p = p (1 - lr wd)
    m = b1 m + (1 - b1) g                  v = b2 v + (1 - b2) g^2
    p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    weight16 = p (rounded)

The master, the moments and the 16-bit weights are flat vectors (a ZeRO partition); the
gradients are a list of tensors that lie back to back along them. The reference here is plain
torch on each tensor's slice. ``adamw_master_triton.py`` does the whole list in one launch that
reads each gradient once in its own dtype: 28 bytes per bf16 parameter. The same update through
torch's fused AdamW needs the gradients as one fp32 vector first and the weights copied out
after: 44 bytes (``parallel/zero_step.py`` uses this for DeepSpeed's ZeRO-1/2).

``step`` is a one-element device tensor (torch's fused AdamW keeps it there), read by the
kernel, so nothing syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.kernels import resolve


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def segments(grads: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(offset along the flat vectors, gradient) of each tensor, back to back."""
    out, offset = [], 0
    for g in grads:
        out.append((offset, g))
        offset += g.numel()
    return out


def adamw_master_reference(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                           weight16: torch.Tensor, grads: list[torch.Tensor], step: torch.Tensor,
                           hyper: AdamWHyper, clip: torch.Tensor | None) -> None:
    t = step.double()
    bias1 = 1 - hyper.beta1 ** t
    bias2_sqrt = (1 - hyper.beta2 ** t).sqrt()
    step_size = (hyper.lr / bias1).float()
    for offset, grad in segments(grads):
        n = grad.numel()
        p, m, v = (x.narrow(0, offset, n) for x in (master, exp_avg, exp_avg_sq))
        g = grad.reshape(-1).float()
        if clip is not None:
            g = g / clip
        p.mul_(1 - hyper.lr * hyper.weight_decay)
        m.mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        denom = (v.sqrt() / bias2_sqrt.float()).add_(hyper.eps)
        p.sub_(step_size * m / denom)
        weight16.narrow(0, offset, n).copy_(p)


def adamw_master_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      weight16: torch.Tensor, grads: list[torch.Tensor], step: torch.Tensor,
                      hyper: AdamWHyper, clip: torch.Tensor | None, impl: str = "auto") -> None:
    """One AdamW step of the flat fp32 ``master`` (and its moments) from ``grads``, which lie back to
    back from its start; ``weight16`` gets the rounded result. ``step`` must already count this
    step. In place; returns nothing."""
    if sum(g.numel() for g in grads) > master.numel():
        raise ValueError(f"gradients of {sum(g.numel() for g in grads)} elements for {master.numel()} master weights")
    if resolve(impl, master) == "fused":
        from megatrain.kernels.adamw_master_triton import adamw_master_fused

        return adamw_master_fused(master, exp_avg, exp_avg_sq, weight16, segments(grads), step, hyper.lr,
                                  hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, clip)
    return adamw_master_reference(master, exp_avg, exp_avg_sq, weight16, grads, step, hyper, clip)
