"""FP8 building blocks over torchao, for a model whose linears torchao converted: the e4m3 cast a
``Float8Linear`` would make of its input, and its GEMM without the bias. ``megatrain/precision/``
decides where they are used (``fp8_casts.py``); ``fp8_gelu.py`` fuses the cast into bias + GeLU.

torchao is imported at the top: this module is only imported for ``train.precision=fp8``, and its
functions run inside compiled blocks, where an import would break the graph.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole


def is_float8(x: torch.Tensor) -> bool:
    return isinstance(x, Float8TrainingTensor)


def to_float8(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """x [..., k] (bf16) -> the Float8TrainingTensor that ``linear``'s own forward cast would make
    (e4m3, one scale from x's amax); an already-cast x is returned as it is."""
    if is_float8(x):
        return x
    config = linear.config
    if torch.is_autocast_enabled():  # as Float8Linear.forward: the cast reads the autocast dtype
        x = x.to(torch.get_autocast_gpu_dtype())
    return hp_tensor_to_float8_dynamic(x, config.cast_config_input.target_dtype, linear.linear_mm_config,
                                       gemm_input_role=GemmInputRole.INPUT,
                                       round_scales_to_power_of_2=config.round_scales_to_power_of_2)


def fp8_matmul(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ linear.weight^T`` through a converted linear's FP8 GEMM, without its bias: the body
    of ``Float8Linear.forward`` before the bias add."""
    if torch.is_autocast_enabled():  # as Float8Linear.forward: the GEMM's inputs in the autocast dtype
        x = x.to(torch.get_autocast_gpu_dtype())
    return matmul_with_hp_or_float8_args.apply(x, linear.weight.t(), linear.linear_mm_config, linear.config)
