"""Build the model so that no rank ever holds a full replica: on the meta device first, then
memory only for this rank's pipeline stage and tensor-parallel shard.

    GPT(cfg) on torch.device("meta")         shapes only, no memory (175B: 0 bytes)
    -> tensor parallel (parallelize)          shards are still meta tensors
    -> materialize this stage's parameters    empty tensors on the device, then initialized
    -> pipeline split (parallelize)           DeepSpeed keeps this stage's layers

Small recipes keep the plain path (``GPT(cfg)`` on the device, then ``parallelize``), which
starts from exactly the weights a single process would have: the parity tests rely on it. A
meta-built model is initialized per parameter with GPT-2's rule (``init_weights``: N(0, std),
residual projections scaled by 1/sqrt(2 n_layer), zero biases, unit norm gains) from a seed
derived from the parameter's name (and its TP rank when it is sharded): replicas on other DP
ranks, and the tied embedding on the first and last stage, get identical values without
communication; the values differ from the plain path's.

Materializing swaps each meta parameter for a real one in place (``torch.utils.swap_tensors``,
keeping the object every module and DeepSpeed refer to and its attributes); autograd hooks do not
survive the swap, so the sequence-parallel gradient hooks tensor parallelism registered are
registered again.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch
import torch.nn as nn

from megatrain.config import Config
from megatrain.model.gpt import GPT, count_parameters, expected_parameter_count
from megatrain.parallel.dims import ProcessGroups
from megatrain.parallel.parallelize import parallelize

META_ABOVE_PARAMS = 10e9  # parallel.init.meta_init=auto: meta build above this many parameters


def use_meta(cfg: Config) -> bool:
    mode = cfg.parallel.init.meta_init
    return mode == "always" or (mode == "auto" and expected_parameter_count(cfg.model) > META_ABOVE_PARAMS)


def build_on_meta(cfg: Config) -> GPT:
    """The whole model's shapes, no storage."""
    with torch.device("meta"):
        return GPT(cfg.model)


def stage_modules(model: GPT, cfg: Config, groups: ProcessGroups) -> list[nn.Module]:
    """The modules this rank's pipeline stage will hold, partitioned exactly as
    ``pipeline.build_pipeline_module`` asks DeepSpeed to (blocks balanced over stages; the tied
    embedding on the first and the last stage)."""
    if groups.dims.pp == 1:
        return [model]
    from deepspeed.runtime.utils import partition_balanced

    from megatrain.parallel.pipeline import BLOCK_TYPES, pipeline_layers

    layers = pipeline_layers(model)
    modules = [getattr(layer, "module", layer) for layer in layers]
    pattern = re.compile("|".join(BLOCK_TYPES), re.IGNORECASE)
    weights = [1 if pattern.search(type(m).__name__) else 0 for m in modules]
    parts = partition_balanced(weights=weights, num_parts=groups.dims.pp)
    return modules[parts[groups.pp_rank]:parts[groups.pp_rank + 1]]


def _seed(name: str, base: int, tp_rank: int | None) -> int:
    text = f"{base}:{name}:{'' if tp_rank is None else tp_rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def _init_value(name: str, module: nn.Module, param: nn.Parameter, cfg: Config, generator: torch.Generator) -> None:
    """GPT-2's rule by parameter name, as ``model.gpt.init_weights`` applies it by module type."""
    with torch.no_grad():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1 and "norm" in type(module).__name__.lower():
            param.fill_(1.0)
        else:
            std = cfg.model.init_std
            if name.endswith("proj.weight"):
                std /= math.sqrt(2 * cfg.model.n_layer)
            param.normal_(0.0, std, generator=generator)


def materialize(model: GPT, cfg: Config, groups: ProcessGroups, device: torch.device) -> int:
    """Give this stage's meta parameters storage on ``device`` and initialize them; returns the
    number of elements materialized (everything else stays on meta)."""
    from megatrain.parallel.tensor_parallel import _all_reduce_grad_over

    keep = {id(m) for stage_module in stage_modules(model, cfg, groups) for m in stage_module.modules()}
    owners = {id(p): (name, module) for module_name, module in model.named_modules()
              for name, p in ((f"{module_name}.{n}", p) for n, p in module.named_parameters(recurse=False))}
    done, elements = set(), 0
    for module in model.modules():
        if id(module) not in keep:
            continue
        for param in module.parameters(recurse=False):
            if id(param) in done or not param.is_meta:
                continue
            done.add(id(param))
            name, owner = owners[id(param)]
            real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                requires_grad=param.requires_grad)
            real.__dict__.update(param.__dict__)  # tensor_model_parallel, partition_dim, ...
            sharded = getattr(param, "tensor_model_parallel", False)
            generator = torch.Generator(device=device).manual_seed(
                _seed(name, cfg.train.seed, groups.tp_rank if sharded else None))
            _init_value(name, owner, real, cfg, generator)
            torch.utils.swap_tensors(param, real)
            if getattr(param, "sequence_parallel", False) and groups.dims.tp > 1:
                _all_reduce_grad_over(param, groups.tp_group)  # the hook did not survive the swap
            elements += param.numel()
    return elements


def build_parallel_model(cfg: Config, groups: ProcessGroups, device: torch.device,
                         init_weights: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, int]:
    """(this rank's parallelized model, the full model's parameter count). ``init_weights`` loads
    starting weights into the plain, whole model before it is parallelized (the trainer passes the
    loader of ``checkpoint.init_from: hf:<dir>``)."""
    from megatrain.config import ConfigError

    if not use_meta(cfg):
        # Built on the device itself: the 1.3B recipe spent 16-26 s initialising on one CPU thread
        # (each weight twice: nn's default init, then GPT-2's) and copying to the GPU. On a CPU the
        # weights are the same as before; on a GPU they come from the device's generator (seeded alike).
        with torch.device(device):
            model = GPT(cfg.model)
        if init_weights is not None:
            init_weights(model)
        return parallelize(model, cfg, groups), count_parameters(model)
    if init_weights is not None:
        raise ConfigError(
            "checkpoint.init_from: hf: loads a full replica on every rank, which a meta-device build exists to avoid; "
            "set parallel.init.meta_init=never (the whole model must then fit on one rank)"
        )
    model = build_on_meta(cfg)
    n_params = count_parameters(model)
    return parallelize(model, cfg, groups, materialize=lambda m: materialize(m, cfg, groups, device)), n_params
