"""The routed experts of ``model.mlp=moe``: E SwiGLU feed-forwards computed over tokens already
sorted by expert (``moe.dispatch``), and three ways to compute them, chosen by
``model.kernels.experts``:

- ``reference``: a Python loop, one ``proj(swiglu(fc(x_e)))`` per expert's segment (the plain
  definition; the other two are held to it by tests/megatrain/model/test_moe.py);
- ``padded``: each segment copied into an [E, C, d] buffer (C = the busiest expert's tokens),
  three batched matmuls, the rows read back. Wastes (E C - M) rows of work; fine on a CPU;
- ``grouped``: ``torch._grouped_mm`` over the segments with offsets (one kernel per projection,
  no padding, no host sync: the offsets stay on the device). Hopper + bf16 is where it pays;
  torch 2.13's CPU fallback computes it too (about 10x slower than ``padded`` there, and its
  backward needs a dense upstream gradient).

Weights (no biases): ``fc`` [E, 2 ff, d] holds each expert's gate rows then up rows, like
``mlp.SwiGLU.fc`` (Hugging Face Qwen3-MoE/OLMoE ``experts.{e}.gate_proj`` = fc[e, :ff],
``up_proj`` = fc[e, ff:]); ``proj`` [E, d, ff] (``down_proj``).

``scale`` [M] (optional) multiplies each row's SwiGLU output, before the down projection: the
MoE layer passes the router's weights there when its experts are local (``model/moe.py``).

Expert parallelism: a rank would hold experts ``first .. first + E_local - 1`` of the global ids
the router chooses; ``first`` is 0 while one rank holds them all.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain.kernels.swiglu import swiglu


def experts_reference(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                      act_impl: str = "reference", scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, d] sorted by expert, counts [E], scale [M] or None -> [M, d]: one expert at a time."""
    sizes = counts.tolist()
    scales = scale.split(sizes) if scale is not None else [None] * len(sizes)
    outs = [F.linear(swiglu(F.linear(xe, fc[e]), act_impl, ce), proj[e])  # [n_e, 2ff] -> [n_e, ff] -> [n_e, d]
            for e, (xe, ce) in enumerate(zip(x.split(sizes), scales))]
    return torch.cat(outs) if outs else x.new_zeros(0, proj.shape[1])


def experts_padded(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                   act_impl: str = "reference", scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, d] sorted by expert, counts [E] -> [M, d]: segments padded to the longest, bmm."""
    n_experts, (m, d) = counts.numel(), x.shape
    capacity = int(counts.max()) if m else 0
    expert = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts)  # [M] each row's expert
    start = torch.cumsum(counts, 0) - counts  # [E] first row of each segment
    slot = torch.arange(m, device=x.device) - start[expert]  # [M] row within its segment
    buf = x.new_zeros(n_experts, capacity, d)
    buf = buf.index_put((expert, slot), x)  # [E, C, d]
    h = torch.bmm(buf, fc.transpose(1, 2))  # [E, C, 2ff]
    if scale is not None:
        scale = scale.new_zeros(n_experts, capacity).index_put((expert, slot), scale)  # [E, C]
    y = torch.bmm(swiglu(h, act_impl, scale), proj.transpose(1, 2))  # [E, C, d]
    return y[expert, slot]  # [M, d]


def experts_grouped(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                    act_impl: str = "reference", scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, d] sorted by expert, counts [E] -> [M, d]: ``torch._grouped_mm`` over the segments."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each segment
    h = torch._grouped_mm(x, fc.transpose(-2, -1), offs=offsets)  # [M, 2ff]
    return torch._grouped_mm(swiglu(h, act_impl, scale), proj.transpose(-2, -1), offs=offsets)  # [M, d]


def experts_fp8(x: torch.Tensor, counts: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
                act_impl: str = "reference", scale: torch.Tensor | None = None, emulate: bool = False) -> torch.Tensor:
    """``experts_grouped`` with both projections as FP8 grouped GEMMs (``kernels/fp8_grouped.py``;
    ``emulate``: the FP8 round trip on any device)."""
    from megatrain.kernels.fp8_grouped import grouped_mm_fp8

    offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each segment
    h = grouped_mm_fp8(x, fc.transpose(-2, -1), offsets, emulate)  # [M, 2ff]
    return grouped_mm_fp8(swiglu(h, act_impl, scale), proj.transpose(-2, -1), offsets, emulate)  # [M, d]


EXPERT_PATHS = {"reference": experts_reference, "padded": experts_padded, "grouped": experts_grouped}


def resolve_experts_impl(impl: str, x: torch.Tensor) -> str:
    """``auto``: grouped on a CUDA device of compute capability 9+ in bf16 (torch._grouped_mm's
    fast case), padded everywhere else."""
    if impl != "auto":
        return impl
    fast = (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return "grouped" if fast else "padded"


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts of width ``d_ff`` (global ids ``first`` .. ``first + n - 1``)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, impl: str = "auto", act_impl: str = "auto",
                 first: int = 0):
        super().__init__()
        self.fc = nn.Parameter(torch.empty(n_experts, 2 * d_ff, d_model))  # [E, 2ff, d] gate rows, then up rows
        self.proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))  # [E, d, ff]
        self.impl, self.act_impl, self.first = impl, act_impl, first
        self.fp8: str | None = None  # set by precision.apply_precision: "scaled" (FP8 GEMMs) or "emulate"

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """As the dense MLP: fc N(0, std); proj writes into the residual stream, N(0, residual_std)."""
        nn.init.normal_(self.fc, mean=0.0, std=std)
        nn.init.normal_(self.proj, mean=0.0, std=residual_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, d] sorted by expert, counts [E], scale [M] or None -> [M, d]."""
        x = x.to(self.fc.dtype)
        if self.fp8:
            return experts_fp8(x, counts, self.fc, self.proj, self.act_impl, scale, emulate=self.fp8 == "emulate")
        return EXPERT_PATHS[resolve_experts_impl(self.impl, x)](x, counts, self.fc, self.proj, self.act_impl, scale)

    def extra_repr(self) -> str:
        e, two_ff, d = self.fc.shape
        fp8 = f", fp8={self.fp8}" if self.fp8 else ""
        return f"experts={e}, d_model={d}, d_ff={two_ff // 2}, first={self.first}, impl={self.impl}{fp8}"

