"""Casting each activation to FP8 once (``train.fp8.casts``: ``once`` / ``fused``).

torchao's ``Float8Linear`` casts its input inside its autograd function: to e4m3 in the forward
for the output GEMM, and again in the backward, from the bf16 input it saved, for the
weight-gradient GEMM. Under tensorwise scaling the two casts are the same function of the same
tensor (one amax over the whole tensor, one scale), and the parallel block feeds one normalised
input to two linears (attention's qkv and the MLP's fc), so torchao casts that tensor four
times per step. Here megatrain casts each activation once and hands the ``Float8TrainingTensor``
to torchao's GEMM (``matmul_with_hp_or_float8_args`` takes an already-cast argument as it is),
whose autograd function then saves the FP8 copy (half the bf16 bytes) for the weight gradient:

- every converted linear: ``x8 = cast(x)``, the FP8 GEMM, then the bias;
- the parallel block: ``h8 = cast(ln(x))`` once, read by qkv and fc (forward and backward);
- the GeLU MLP under ``fused``: bias + GeLU + amax + e4m3 cast in Triton (``megatrain/kernels/
  fp8_gelu.py``): the bf16 GeLU output is never written, only its e4m3 copy.

The gradient of a cast is the identity (torchao's ``_ToFloat8ConstrFunc``), and the cast values
and scales are torchao's own, so ``once`` computes what ``torchao`` computes (tests compare the
two). Rowwise recipes scale the input along different axes for the forward and the weight
gradient, so only tensorwise can share one copy: other recipes keep torchao's casts.

Measured on one H200 (1.3B, compiled blocks, benchmarks/RESULTS.md): ``once`` 0.8% faster than
``torchao``, inside the noise: under torch.compile inductor already merges torchao's backward
re-casts with the forward's and saves the FP8 copies. In eager mode nothing does, and ``once``
casts 9 times per 3 parallel blocks instead of 24. ``fused`` was 5% slower, before a fix not yet re-measured (see fp8_gelu_triton.py).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

# Imported at the top (this module is only imported for train.precision=fp8): these functions run
# inside compiled blocks, where a graph break between a cast and its GEMMs would make the FP8
# tensor a graph output, which AOTAutograd cannot take a plain gradient for.
from torchao.float8.config import ScalingGranularity, ScalingType

from megatrain.kernels.fp8_gelu import bias_gelu_float8
from megatrain.kernels.fp8_ops import fp8_matmul, to_float8
from megatrain.model.block import ParallelBlock
from megatrain.model.mlp import MLP


def can_cast_once(config) -> bool:
    """True when a ``Float8LinearConfig`` casts the input the same way for the output GEMM and for
    the weight-gradient GEMM, with one dynamic scale per tensor: then one FP8 copy serves both."""
    cast = config.cast_config_input
    return (cast.scaling_type is ScalingType.DYNAMIC and cast.scaling_granularity is ScalingGranularity.TENSORWISE
            and config.cast_config_input_for_grad_weight in (None, cast))


def _mlp_forward_fp8(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
    """``proj(activate(fc(x)))`` (GeLU MLP and SwiGLU alike) with fc's GEMM in FP8. The GeLU MLP's
    plain forward runs ``F.linear(x, fc.weight)`` and hands fc's bias to the bias-GeLU kernel,
    which would bypass the Float8Linear; calling the Float8Linear instead would add the bias in a
    pass of its own over [tokens, ff] (and reduce its gradient in another). So: the FP8 GEMM
    without bias, then the activation with the bias, as in bf16 (+2.5% tokens/s at 1.3B on an
    H200 over calling the Float8Linear: benchmarks/RESULTS.md)."""
    h = fp8_matmul(mlp.fc, x)  # [B, T, ff]
    return mlp.proj(mlp.activate(h, mlp.fc.bias))


def route_through_converted(model: nn.Module, float8_linear: type) -> None:
    """Feed-forward modules (``fc``, ``activate``, ``proj``: megatrain's GeLU MLP and SwiGLU) run
    ``_mlp_forward_fp8``; the GeLU MLP's own forward reads ``fc.weight`` directly."""
    for module in model.modules():
        fc = getattr(module, "fc", None)
        if isinstance(fc, float8_linear) and hasattr(module, "activate") and hasattr(module, "proj"):
            module.forward = types.MethodType(_mlp_forward_fp8, module)


def _add_bias(out: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    return out if linear.bias is None else out + linear.bias.to(out.dtype)


def _linear_forward_once(self: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [..., k] -> [..., n]
    """A converted linear's forward with its input cast here, once (see the module docstring)."""
    return _add_bias(fp8_matmul(self, to_float8(x, self)), self)


def _mlp_forward_once(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
    """fc's FP8 GEMM without bias, the activation with the bias (as in bf16), then proj, which
    casts its input once."""
    h = fp8_matmul(mlp.fc, to_float8(x, mlp.fc))  # [B, T, ff]
    return mlp.proj(mlp.activate(h, mlp.fc.bias))


def _mlp_forward_fused(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
    """As ``_mlp_forward_once``, with bias + GeLU and the e4m3 cast of its output in one kernel pair."""
    h = fp8_matmul(mlp.fc, to_float8(x, mlp.fc))  # [B, T, ff]
    g8 = bias_gelu_float8(h, mlp.fc.bias, mlp.proj, mlp.impl)  # Float8TrainingTensor [B, T, ff]
    return _add_bias(fp8_matmul(mlp.proj, g8), mlp.proj)


def _parallel_block_forward_once(block: nn.Module, x: torch.Tensor, cache=None) -> torch.Tensor:
    """y = x + attn(h8) + mlp(h8) with h8 = cast(ln(x)) once for qkv and fc; decoding with a
    cache takes the block's own forward."""
    if cache is not None:
        return type(block).forward(block, x, cache)
    h8 = to_float8(block.ln(x), block.attn.qkv)  # [B, T, d] e4m3
    return x + (block.attn(h8) + block.mlp(h8))  # the block's own order of the bf16 sums


def route_casts(model: nn.Module, casts: str, float8_linear: type) -> None:
    """Rebind the forwards of the converted model so each activation is cast once (``casts`` once
    or fused); ``torchao`` leaves torchao's casts. Linears whose config cannot share a cast keep
    their own forward. Tensor-parallel blocks never get here (FP8 with TP is refused in config)."""
    if casts == "torchao":
        return
    once = {id(m) for m in model.modules() if isinstance(m, float8_linear) and can_cast_once(m.config)}
    for module in model.modules():
        if id(module) in once:
            module.forward = types.MethodType(_linear_forward_once, module)
        fc, proj = getattr(module, "fc", None), getattr(module, "proj", None)
        if id(fc) in once and id(proj) in once and hasattr(module, "activate"):
            fused = casts == "fused" and type(module) is MLP  # the GeLU MLP; SwiGLU casts after its kernel
            module.forward = types.MethodType(_mlp_forward_fused if fused else _mlp_forward_once, module)
        if (isinstance(module, ParallelBlock) and id(module.attn.qkv) in once and id(getattr(module.mlp, "fc", None)) in once
                and type(module.enter) is nn.Identity and type(module.exit) is nn.Identity):
            module.forward = types.MethodType(_parallel_block_forward_once, module)
