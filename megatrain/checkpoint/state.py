"""What a checkpoint holds, taken from (and put back into) a live trainer.

A rank's training state is split into three parts, matching the files of ``files.py``:

- model tensors: the module's parameters and persistent buffers. Data-parallel replicas hold the
  same values, so only dp_rank 0 of each (pp, tp) shard writes them and, on restore, reads them and
  broadcasts them over its DP group.
- rank tensors: this rank's optimizer state and RNG tensors. Under ZeRO stage 1/2 this is the
  rank's own partition: the fp32 master weights (``single_partition_of_fp32_groups``) and the base
  optimizer's moments for that flat partition. Every rank writes and reads its own.
- rank metadata (JSON): step, LR schedule, data-loader position, python/numpy RNG, DeepSpeed's
  step counters and the optimizer's hyper-parameters (lr set by the schedule, betas, ...).

Tensors are taken by reference, not copied: ``snapshot.py`` copies them into host buffers. Putting
state back copies into the existing tensors in place (``copy_``), because DeepSpeed's model
parameters are views into flat buffers and LAMB keys its ZeRO segments by the partition tensor's
identity: replacing a tensor object would silently detach either.

DeepSpeed's own ``optimizer.state_dict()`` is not used: it pickles a loss-scaler object (so it
cannot be loaded with ``weights_only``) and returns freshly sliced tensors each call, which would
defeat reused pinned buffers.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch
import torch.nn as nn

_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_JSON_SCALARS = (bool, int, float, str, type(None))


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name; a tensor shared under two names appears once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        tensor = tensor.detach()
        # (ZeRO-3 leaves empty placeholders, all at one address: those are told apart by name)
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else name
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def _is_zero3(optimizer: Any) -> bool:
    return hasattr(optimizer, "fp32_partitioned_groups_flat") and hasattr(optimizer, "optimizer")


def _is_zero(optimizer: Any) -> bool:
    """DeepSpeed's ZeRO optimizer, stage 1/2 or 3: fp32 master partitions, one per (sub-)group."""
    return (hasattr(optimizer, "single_partition_of_fp32_groups") and hasattr(optimizer, "optimizer")) or _is_zero3(optimizer)


def kind_of(optimizer: Any) -> str:
    return "zero3" if _is_zero3(optimizer) else "zero" if _is_zero(optimizer) else "torch"


def fp32_partitions(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 master-weight partitions under ZeRO (stage 3: each parameter's own
    slice, concatenated per sub-group; stage 1/2: a slice of the group's flat buffer)."""
    if _is_zero3(optimizer):
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def _json_value(value: Any) -> Any | None:
    """``value`` if JSON can hold it (tuples become lists), else None."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _JSON_SCALARS) for v in value):
        return list(value)
    return None


def _hyperparameters(param_groups: list[dict]) -> list[dict[str, Any]]:
    return [{k: _json_value(v) for k, v in g.items() if k != "params" and _json_value(v) is not None} for g in param_groups]


def _state_entries(optimizer: Any) -> list[tuple[str, torch.Tensor, dict]]:
    """(name prefix, parameter, its state dict) for every parameter the optimizer updates."""
    if _is_zero3(optimizer):
        base = optimizer.optimizer
        return [(f"zero.{i}", flat, base.state[flat]) for i, flat in enumerate(fp32_partitions(optimizer))]
    if _is_zero(optimizer):
        base = optimizer.optimizer
        return [(f"zero.{i}", g["params"][0], base.state[g["params"][0]]) for i, g in enumerate(base.param_groups)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return [(f"torch.{i}.{j}", p, optimizer.state[p]) for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])]
    raise NotImplementedError(
        f"checkpointing {type(optimizer).__name__} is not supported: expected DeepSpeed's ZeRO stage 1/2/3 "
        "optimizer or a torch.optim.Optimizer (zero_stage 0 with fp32)"
    )


def check_checkpointable(optimizer: Any) -> None:
    """Raise now, before the first step, for an optimizer wrapper whose state this module cannot
    save (DeepSpeed's bf16 ZeRO-0 wrappers keep fp32 copies of their own): otherwise the run would
    train up to its first checkpoint and fail there."""
    _state_entries(optimizer)


def optimizer_state(optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of this rank's optimizer; ZeRO: its partition incl. fp32 master weights."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    on_cpu: list[str] = []  # state tensors that live on the CPU although the parameter does not (LAMB's step)
    for prefix, param, state in _state_entries(optimizer):
        for key, value in state.items():
            name = f"{prefix}.state.{key}"
            if torch.is_tensor(value):
                tensors[name] = value.detach()
                if value.device != param.device:
                    on_cpu.append(name)
            elif _json_value(value) is not None:
                scalars[name] = _json_value(value)
    if _is_zero(optimizer):
        for i, flat in enumerate(fp32_partitions(optimizer)):
            tensors[f"zero.{i}.fp32"] = flat.detach()
        groups = optimizer.optimizer.param_groups
    else:
        groups = optimizer.param_groups
    meta = {"kind": kind_of(optimizer), "param_groups": _hyperparameters(groups),
            "scalars": scalars, "state_on_cpu": on_cpu}
    return tensors, meta


def load_optimizer_state(optimizer: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                         hyperparameters: bool = True) -> None:
    """Put saved optimizer state back in place; state the optimizer has not created yet (it is
    created lazily at the first step) is created on the device it was saved from. With
    ``hyperparameters`` the param groups' lr (set by the schedule), betas, ... come back too."""
    kind = kind_of(optimizer)
    if meta["kind"] != kind:
        raise ValueError(f"checkpoint holds a {meta['kind']} optimizer state, this run uses {kind}")
    on_cpu = set(meta["state_on_cpu"])
    expected = {name for name in tensors if ".state." in name}
    for prefix, param, state in _state_entries(optimizer):
        for name in [n for n in tensors if n.startswith(f"{prefix}.state.")]:
            key = name[len(prefix) + len(".state."):]
            saved = tensors[name]
            if key in state and torch.is_tensor(state[key]):
                _copy_exact(state[key], saved, name)
            else:
                state[key] = saved.to("cpu" if name in on_cpu else param.device).clone()
            expected.discard(name)
        for name, value in meta["scalars"].items():
            if name.startswith(f"{prefix}.state."):
                state[name[len(prefix) + len(".state."):]] = value
    if expected:
        raise ValueError(f"optimizer state for parameters this run does not have: {sorted(expected)[:3]}")
    if kind != "torch":
        for i, flat in enumerate(fp32_partitions(optimizer)):
            _copy_exact(flat, tensors[f"zero.{i}.fp32"], f"zero.{i}.fp32")
    if kind == "zero3":
        sync_zero3_weights(optimizer)
    if hyperparameters:
        load_hyperparameters(optimizer, meta["param_groups"])
    if kind == "zero" and hasattr(optimizer, "_link_all_hp_params"):
        optimizer._link_all_hp_params()  # DeepSpeed's own load does this: re-point fragment views


def sync_zero3_weights(optimizer: Any) -> None:
    """ZeRO-3: the model's parameter partitions (views into one flat buffer per sub-group) from
    the fp32 master partitions, as DeepSpeed's optimizer step leaves them."""
    with torch.no_grad():
        for flat16, flat32 in zip(optimizer.fp16_partitioned_groups_flat, fp32_partitions(optimizer), strict=True):
            flat16.copy_(flat32)


def load_hyperparameters(optimizer: Any, saved_groups: list[dict[str, Any]]) -> None:
    """The param groups' lr (set by the schedule), betas, weight decay... as saved."""
    groups = optimizer.optimizer.param_groups if _is_zero(optimizer) else optimizer.param_groups
    for group, saved in zip(groups, saved_groups, strict=True):
        for key, value in saved.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


def _copy_exact(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"{name}: checkpoint has {src.dtype}{list(src.shape)}, this run {dst.dtype}{list(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def load_model_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], names: set[str] | None = None) -> None:
    """Copy ``tensors`` into the module in place: every model tensor, or exactly ``names`` (a
    rank that reads only some of the weights, e.g. its slice of the experts)."""
    live = model_tensors(module)
    if names is not None:
        live = {name: tensor for name, tensor in live.items() if name in names}
    if set(live) != set(tensors):
        missing, extra = sorted(set(live) - set(tensors)), sorted(set(tensors) - set(live))
        raise ValueError(f"model tensors differ from the checkpoint: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in live.items():
        _copy_exact(tensor, tensors[name], name)


def rng_state(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every random generator the training step can draw from: torch CPU, CUDA, python, numpy."""
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, meta


def load_rng_state(device: torch.device, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    # Cloned: set_rng_state given a view at an offset into a larger buffer (restore reads each file
    # into one buffer and hands out views) dies of SIGSEGV (seen on torch 2.13, CPU).
    torch.set_rng_state(tensors["rng.torch_cpu"].clone())
    if device.type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"].clone(), device)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def engine_counters(engine: Any) -> dict[str, int]:
    """DeepSpeed's step/sample counters (they decide gradient-accumulation boundaries)."""
    return {name: int(getattr(engine, name)) for name in _ENGINE_COUNTERS if hasattr(engine, name)}


def load_engine_counters(engine: Any, counters: dict[str, int]) -> None:
    for name, value in counters.items():
        if hasattr(engine, name):
            setattr(engine, name, value)


def scheduler_state(scheduler: Any) -> dict[str, Any] | None:
    """The LR scheduler's state_dict, which must be plain JSON (a LambdaLR's lambdas are not saved)."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    try:
        json.dumps(state)
    except TypeError as exc:
        raise TypeError(f"{type(scheduler).__name__}.state_dict() is not plain JSON: {exc}") from None
    return state
