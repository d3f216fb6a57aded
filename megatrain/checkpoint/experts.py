"""Who writes, reads and shares which weights of a checkpoint, expert parallelism included.

Without expert parallelism (``parallel.ep`` = 1) every data-parallel replica holds the same
weights: dp_rank 0 of each (pp, tp) shard writes ``model-ppPP-tpTT.safetensors``, reads it on
restore and broadcasts it over its DP group.

Under ``parallel.ep`` = E > 1 (parallel/expert_parallel.py) the routed experts are not replicated
over DP: EP rank e (dp_rank d with d % E = e) holds experts ``e n/E .. (e+1) n/E - 1`` of every MoE
layer, the same as the other ranks of its expert-data-parallel (EDP) group. So a step holds

    model-ppPP-tpTT.safetensors       everything but the routed experts, from dp_rank 0
    model-ppPP-tpTT-epEE.safetensors  EP rank e's slice of every expert tensor (its live name and
                                      local shape), from dp_rank e: the first rank of EDP group e

and every expert is written exactly once. On a restore at the same layout the same ranks read
them; dp_rank 0 broadcasts the replicated weights over DP, and the first rank of each EDP group
its experts over that group. Optimizer state needs nothing new: ZeRO-0 (all EP composes with)
keeps each rank's state in its own rank file, the expert moments as the rank's slice.

The parameter map (reshard.py) records each expert tensor's slice, ``"ep": {canonical name:
[first expert, experts of the layer]}``: a restore at another ep degree joins the old EP ranks'
slices in order (expert i lies on old EP rank i // (n / E)) and cuts this rank's (``join``, ``cut``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from megatrain.checkpoint import state
from megatrain.checkpoint.files import model_file
from megatrain.parallel.dims import ProcessGroups
from megatrain.parallel.expert_parallel import expert_slice, is_expert_param


def expert_names(module: nn.Module) -> set[str]:
    """Live names of the expert shards (empty without expert parallelism)."""
    return {name for name, p in module.named_parameters() if is_expert_param(p)}


def ep_map(module: nn.Module, names: dict[int, str]) -> dict[str, list[int]]:
    """Canonical name -> [first expert, experts of the layer] of each expert shard (``names``:
    id(parameter) -> canonical name)."""
    return {names[id(p)]: list(expert_slice(p)) for p in module.parameters() if expert_slice(p) is not None}


def model_files(module: nn.Module, groups: ProcessGroups) -> dict[str, dict[str, torch.Tensor]]:
    """The model files this rank writes (none on most ranks), each with its tensors by live name."""
    g, ep = groups, groups.dims.ep
    tensors = state.model_tensors(module)
    if ep == 1:
        return {model_file(g.pp_rank, g.tp_rank): tensors} if g.dp_rank == 0 else {}
    experts = expert_names(module)
    out = {}
    if g.dp_rank == 0:
        out[model_file(g.pp_rank, g.tp_rank)] = {n: t for n, t in tensors.items() if n not in experts}
    if g.dp_rank < ep:
        out[model_file(g.pp_rank, g.tp_rank, g.dp_rank)] = {n: t for n, t in tensors.items() if n in experts}
    return out


def weight_files(groups: ProcessGroups) -> list[str]:
    """The names of ``model_files``: what this rank writes, and reads back at the same layout."""
    g, ep = groups, groups.dims.ep
    names = [model_file(g.pp_rank, g.tp_rank)] if g.dp_rank == 0 else []
    if ep > 1 and g.dp_rank < ep:
        names.append(model_file(g.pp_rank, g.tp_rank, g.dp_rank))
    return names


def read_weights(groups: ProcessGroups, read: Callable[[str], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """This rank's weight files merged (``read(file name)`` gives one file's tensors); None when
    the rank reads none (its weights come by broadcast)."""
    names = weight_files(groups)
    if not names:
        return None
    merged: dict[str, torch.Tensor] = {}
    for name in names:
        merged.update(read(name))
    return merged


def names_read(module: nn.Module, groups: ProcessGroups) -> set[str] | None:
    """The live names ``read_weights`` gives this rank: all (None) on dp_rank 0, the experts on
    the other first ranks of an EDP group."""
    return None if groups.dp_rank == 0 else expert_names(module)


def read_expert_weight(load: Callable[[str], dict[str, torch.Tensor]], pp: int, tp: int, ep: int,
                       live: str) -> torch.Tensor:
    """An expert tensor of an old checkpoint with its ``ep`` EP ranks' slices joined (all experts)."""
    return join([load(model_file(pp, tp, e))[live] for e in range(ep)])


def join(parts: list[torch.Tensor]) -> torch.Tensor:
    """EP ranks' slices, in EP rank order -> the whole layer's experts (dim 0)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def cut(param: torch.Tensor | None, full: torch.Tensor, name: str) -> torch.Tensor:
    """The slice of ``full`` (all experts of a layer, or any replicated tensor) that ``param`` holds."""
    found = expert_slice(param) if param is not None else None
    if found is None:
        return full
    first, total = found
    if full.shape[0] != total:
        raise ValueError(f"{name}: the checkpoint holds {full.shape[0]} experts, this run's layer {total}")
    return full[first:first + param.shape[0]]


def broadcast_weights(module: nn.Module, groups: ProcessGroups) -> None:
    """The ranks that read the weights send them on: dp_rank 0 of this (pp, tp) shard the
    replicated ones over its DP group; under EP the first rank of each EDP group its experts."""
    g = groups
    if g.dims.dp == 1 or not dist.is_initialized():
        return
    experts = expert_names(module) if g.dims.ep > 1 else set()
    src = g.dims.rank_of(g.pp_rank, 0, g.tp_rank)
    expert_src = g.dims.rank_of(g.pp_rank, g.ep_rank, g.tp_rank)
    with torch.no_grad():
        for name, tensor in state.model_tensors(module).items():
            if not tensor.numel():  # ZeRO-3 placeholders: the weights live in the partitions
                continue
            if name not in experts:
                dist.broadcast(tensor, src=src, group=g.dp_group)
            elif g.dims.dp > g.dims.ep:  # EDP groups of more than one rank
                dist.broadcast(tensor, src=expert_src, group=g.edp_group)
