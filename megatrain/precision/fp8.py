"""FP8 training of the transformer blocks' linears through torchao's float8 (``train.precision: fp8``).

What converts (``fp8_plan``): every ``nn.Linear`` under ``model.blocks`` (attention qkv/proj, MLP
fc/proj, whatever the family names them) but an MoE router's gate, and with ``train.fp8.experts``
the MoE expert banks (FP8 grouped GEMMs, ``kernels/fp8_grouped.py``), except block 0 / the last block when
``train.fp8.keep_first_block`` / ``keep_last_block`` say so, and linears whose features are not
multiples of 16 (``torch._scaled_mm`` needs that). What never converts: the embeddings and the LM
head (outside ``blocks``; the head reads the tied embedding matrix), the norms and attention.

A converted linear is torchao's ``Float8Linear``: same parameters (weight, bias; no buffers),
so checkpoints are interchangeable with bf16 runs. Its forward casts input and weight to
float8_e4m3 with scales computed from their current amax (dynamic scaling), runs
``torch._scaled_mm``, and casts the output gradient to e5m2 (tensorwise) in the backward. Under
``torch.compile`` the amax reductions and casts fuse with their neighbours; in eager they are
separate kernels and FP8 is slower than bf16, hence the warning below. ``train.fp8.casts`` lets
megatrain cast each activation once instead (``fp8_casts.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import types

import torch
import torch.nn as nn

from megatrain.config import Config, FP8Config
from megatrain.config import ConfigError

log = logging.getLogger("megatrain")

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later.
FP8_MIN_CAPABILITY = (8, 9)


def _torchao_float8():
    """Import torchao.float8 quietly: torchao logs a warning for each of its optional C++
    extensions that does not load here (MX / CUTLASS kernels float8 training does not use)."""
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    torchao_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear  # not re-exported by torchao.float8
    finally:
        torchao_log.setLevel(level)
    return types.SimpleNamespace(Float8LinearConfig=Float8LinearConfig, Float8Linear=Float8Linear,
                                 convert_to_float8_training=convert_to_float8_training)


def check_precision_supported(cfg: Config, device: torch.device) -> None:
    """Raise ConfigError (a deterministic error) when ``train.precision`` cannot run on ``device``."""
    if cfg.train.precision != "fp8":
        return
    try:
        _torchao_float8()
    except ImportError as exc:
        raise ConfigError(f"train.precision=fp8 needs torchao (pinned in pyproject.toml: torchao==0.18.0): {exc}") from None
    if cfg.train.fp8.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"train.precision=fp8: this run's device is {device.type}, and FP8 GEMMs need an NVIDIA GPU of "
            f"compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (Ada, Hopper: H100/H200). "
            "Use train.precision=bf16 (or train.fp8.emulate=true, for tests only)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"train.precision=fp8: {torch.cuda.get_device_name(device)} has compute capability "
            f"{capability[0]}.{capability[1]}; FP8 GEMMs need >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
            "(Ada, Hopper: H100/H200). Use train.precision=bf16"
        )


def float8_linear_config(fp8: FP8Config):
    """The torchao ``Float8LinearConfig`` of the recipe, with megatrain's overrides."""
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(fp8.recipe)
    changes = {"emulate": fp8.emulate}
    if fp8.round_scales_to_power_of_2 is not None:
        changes["round_scales_to_power_of_2"] = fp8.round_scales_to_power_of_2
    return dataclasses.replace(config, **changes)


def _block_index(fqn: str) -> int | None:
    """``blocks.3.attn.qkv`` -> 3; None outside the transformer blocks."""
    parts = fqn.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit() else None


def fp8_plan(model: nn.Module, cfg: Config) -> dict[str, str]:
    """Every linear and every MoE expert bank of the model -> "fp8", or the reason it stays in
    high precision. A router's gate stays: its scores choose the experts, and a choice flipped by
    rounding moves a whole token (DeepSeek-V3 keeps it in high precision too)."""
    from megatrain.model.moe import Router
    from megatrain.model.moe_experts import Experts

    n_layer = cfg.model.n_layer
    gates = {f"{fqn}.gate" for fqn, module in model.named_modules() if isinstance(module, Router)}
    plan = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            features, gemm = (module.in_features, module.out_features), "_scaled_mm"
        elif isinstance(module, Experts):
            e, two_ff, d = module.fc.shape
            features, gemm = (d, two_ff // 2, two_ff), "_scaled_grouped_mm"  # the two GEMMs' K and N
        else:
            continue
        block = _block_index(fqn)
        if block is None:
            plan[fqn] = "kept: outside the transformer blocks (embeddings / LM head)"
        elif fqn in gates:
            plan[fqn] = "kept: MoE router (its scores choose the experts)"
        elif isinstance(module, Experts) and not cfg.train.fp8.experts:
            plan[fqn] = "kept: MoE experts (train.fp8.experts is off)"
        elif block == 0 and cfg.train.fp8.keep_first_block:
            plan[fqn] = "kept: first block (train.fp8.keep_first_block)"
        elif block == n_layer - 1 and cfg.train.fp8.keep_last_block:
            plan[fqn] = "kept: last block (train.fp8.keep_last_block)"
        elif any(f % 16 for f in features):
            plan[fqn] = f"kept: {'x'.join(map(str, features))} is not a multiple of 16 ({gemm})"
        else:
            plan[fqn] = "fp8"
    return plan


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The converted linears, by name."""
    float8_linear = _torchao_float8().Float8Linear
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, float8_linear)]


def apply_precision(model: nn.Module, cfg: Config) -> nn.Module:
    """Convert the model in place to ``cfg.train.precision`` (bf16: nothing to do). Call it on the
    plain model, before pipeline splitting, activation checkpointing and compile (they keep the
    converted modules), after ``check_precision_supported``."""
    if cfg.train.precision != "fp8":
        return model
    float8 = _torchao_float8()
    plan = fp8_plan(model, cfg)
    float8.convert_to_float8_training(
        model, config=float8_linear_config(cfg.train.fp8),
        module_filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and plan.get(fqn) == "fp8",
    )
    for fqn, module in model.named_modules():  # MoE experts: FP8 grouped GEMMs (kernels/fp8_grouped.py)
        if plan.get(fqn) == "fp8" and not isinstance(module, nn.Linear):
            module.fp8 = "emulate" if cfg.train.fp8.emulate else "scaled"
    from megatrain.precision.fp8_casts import route_casts, route_through_converted  # torchao at its top

    route_through_converted(model, float8.Float8Linear)
    route_casts(model, cfg.train.fp8.casts, float8.Float8Linear)  # train.fp8.casts: who casts the activations
    converted = [fqn for fqn, how in plan.items() if how == "fp8"]
    log.info("fp8 (%s, casts %s): %d linears and expert banks converted, %d kept in high precision",
             cfg.train.fp8.recipe, cfg.train.fp8.casts, len(converted), len(plan) - len(converted))
    if not cfg.model.compile and not cfg.train.fp8.emulate:
        log.warning("train.precision=fp8 without model.compile: torchao's casts run as separate kernels in eager "
                    "mode, which is usually slower than bf16")
    return model
