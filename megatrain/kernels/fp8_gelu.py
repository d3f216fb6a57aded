"""Bias + GeLU with its output cast to FP8 (e4m3, one tensorwise scale), for the GeLU MLP of an FP8
model (``train.fp8.casts=fused``): reference in torch; fused Triton beside it (``fp8_gelu_triton.py``).

Both return the ``Float8TrainingTensor`` that torchao's cast of ``gelu(h + b)`` would give the
next linear (``proj``): scale = 448 / amax(g), data = e4m3(clamp(g * scale)). The reference is
literally that (the bias-GeLU kernel, then torchao's cast); the fused version never writes the bf16
g: one pass reads h for the amax, a second reads h again and writes the e4m3 bytes (5 bytes per
element instead of 9, and the backward reuses the e4m3 copy). The gradient flows to h and the bias
as through the bias-GeLU alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.kernels import resolve
from megatrain.kernels.gelu import bias_gelu


def bias_gelu_float8_reference(h: torch.Tensor, bias: torch.Tensor | None, linear: nn.Module, impl: str = "auto") -> torch.Tensor:
    """h [..., ff] -> Float8TrainingTensor of gelu(h + bias), cast as ``linear`` (a Float8Linear) would."""
    from megatrain.kernels.fp8_ops import to_float8  # torchao: only imported for FP8

    return to_float8(bias_gelu(h, bias, impl), linear)


def bias_gelu_float8(h: torch.Tensor, bias: torch.Tensor | None, linear: nn.Module, impl: str = "auto") -> torch.Tensor:
    """``impl``: the model's ``kernels.gelu`` choice; fused on CUDA (also inside compiled blocks:
    inductor cannot fuse an amax over the whole tensor into the cast's pass)."""
    if resolve(impl, h, under_compile=None) == "fused":
        from megatrain.kernels.fp8_gelu_triton import bias_gelu_float8_fused

        return bias_gelu_float8_fused(h, bias, linear)
    return bias_gelu_float8_reference(h, bias, linear, impl)
