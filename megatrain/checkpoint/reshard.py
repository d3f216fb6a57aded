"""Layout-independent restore: a checkpoint written at one (dp, tp, pp, ZeRO stage) into another.

Every checkpoint records, per rank, a *parameter map* (``param_map``, saved in the rank's JSON
under ``"shards"``): the canonical name of each tensor (its name in the plain GPT, whatever the
wrappers: pipeline stage, activation checkpointing, compile), how tensor parallelism split it
(dim and interleave), and where it lies in the rank's optimizer state (ZeRO: its offset in the
flat buffer of its parameter group and the slice of that buffer this rank owns).

Restoring into another layout goes through the *full* (unsharded) value of each parameter:

    old files --(read_full_state)--> {canonical name: weight, fp32 master, moments}
              --(apply_full_state)--> this rank's TP shard, its ZeRO slice, in place

1. Rank 0 reads every old rank's JSON (small) and broadcasts it; each rank then knows which old
   files hold the parameters it owns now.
2. Weights: dp_rank 0 of each new (pp, tp) shard reads the old model files of its parameters and
   broadcasts the result over its DP group (MegaScale's one reader per group). Optimizer state
   differs on every rank under ZeRO, so each rank reads the old rank files it needs.
3. ZeRO slices are cut from the old flat buffers (the concatenation of the old DP ranks' slices),
   TP shards are concatenated back (with the interleave of fused QKV), then cut again for the new
   layout. Per-element state (fp32 master, exp_avg, exp_avg_sq) is resharded; a scalar state (the
   step count) is the same on every rank and is copied.
4. Schedule, DeepSpeed's counters and the optimizer's hyper-parameters are the same on every rank:
   they come from old rank 0. The data position is global (samples consumed in the epoch order),
   so the loader re-splits it over the new DP ranks. RNG: a rank restores the streams of the old
   rank with the same global rank when there is one (python/numpy/torch CPU are seeded alike on
   every rank), else keeps its seeded state.
5. Expert parallelism (experts.py): an expert shard's weight and moments are joined from the old
   EP ranks' slices and this rank's slice is cut, so any ep degree restores any other.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from megatrain.checkpoint import experts, state
from megatrain.checkpoint.files import load_safetensors, model_file, rank_meta_file, rank_tensor_file
from megatrain.checkpoint.names import canonical_names, param_names
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from megatrain.parallel.tensor_parallel import join_shards, shard_tensor

log = logging.getLogger("megatrain.checkpoint")


def _tp_split(param: torch.Tensor) -> list | None:
    """[dim, interleave] of a tensor-parallel shard, None for a replicated tensor. ``interleave``
    is a count of equal fused blocks, or the blocks' whole sizes (a grouped-query qkv)."""
    if getattr(param, "partition_dim", None) is None:
        return None
    interleave = getattr(param, "partition_interleave", 1)
    return [int(param.partition_dim), interleave if isinstance(interleave, int) else [int(n) for n in interleave]]


def _zero_groups(optimizer: Any) -> list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]]:
    """(flat buffer, its parameters, this rank's fp32 slice) per ZeRO-1/2 parameter group."""
    return list(zip(optimizer.bit16_groups_flat, optimizer.round_robin_bit16_groups,
                    optimizer.single_partition_of_fp32_groups))


def _offset(param: torch.Tensor, flat: torch.Tensor) -> int:
    """Where ``param`` (a view into ``flat``, as DeepSpeed arranges it) starts, in elements."""
    return (param.data_ptr() - flat.data_ptr()) // param.element_size()


def param_map(module: nn.Module, optimizer: Any, dp_rank: int) -> dict[str, Any]:
    """What a restore at another layout needs to know about this rank's tensors (plain JSON)."""
    names = param_names(module)
    tp = {names[id(p)]: _tp_split(p) for p in module.parameters() if id(p) in names}
    out: dict[str, Any] = {"names": canonical_names(module), "tp": tp}
    ep = experts.ep_map(module, names)
    if ep:  # expert parallelism: each expert shard's slice of its layer (experts.py)
        out["ep"] = ep
    if state._is_zero3(optimizer):  # each parameter's own slice of its flattened (padded) value
        groups = []
        for flat, params in zip(state.fp32_partitions(optimizer), optimizer.fp16_groups):
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.partition_numel())
            groups.append({"numel": flat.numel(), "params": [
                [names[id(p)], offsets[k], p.partition_numel(), list(p.ds_shape)] for k, p in enumerate(params)]})
        out.update(kind="zero3", groups=groups)
    elif state._is_zero(optimizer):
        groups = []
        for flat, params, part in _zero_groups(optimizer):
            groups.append({"flat_numel": flat.numel(), "start": dp_rank * part.numel(), "numel": part.numel(),
                           "params": [[names[id(p)], _offset(p, flat), p.numel(), list(p.shape)] for p in params]})
        out.update(kind="zero", groups=groups)
    else:
        groups = [[[names[id(p)], list(p.shape)] for p in g["params"]] for g in optimizer.param_groups]
        out.update(kind="torch", groups=groups)
    return out


# ---- reading: old files -> full tensors --------------------------------------------------------


@dataclass
class FullParam:
    weight: torch.Tensor | None = None  # the model's tensor (its dtype)
    fp32: torch.Tensor | None = None  # ZeRO's fp32 master (or the weight, without ZeRO)
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # per-element optimizer state


@dataclass
class FullState:
    params: dict[str, FullParam]
    scalars: dict[int, dict[str, Any]]  # group -> scalar optimizer state (LAMB's step)


def _join_tp(shards: list[torch.Tensor], split: list[int] | None) -> torch.Tensor:
    """Inverse of tensor_parallel._shard: TP shards -> the whole tensor."""
    if split is None:
        return shards[0]
    dim, interleave = split
    return join_shards(shards, dim, interleave)


def _cut_tp(full: torch.Tensor, split: list[int] | None, rank: int, world: int) -> torch.Tensor:
    """This TP rank's shard of ``full`` (tensor_parallel._shard's layout)."""
    if split is None or world == 1:
        return full
    dim, interleave = split
    return shard_tensor(full, dim, rank, world, interleave)


def old_dims(manifest: dict[str, Any]) -> ParallelDims:
    layout = manifest["layout"]
    return ParallelDims(dp=int(layout["dp"]), tp=int(layout["tp"]), pp=int(layout["pp"]), ep=int(layout.get("ep", 1)))


def read_full_state(metas: dict[int, dict], dims: ParallelDims, load: Callable[[str], dict[str, torch.Tensor]],
                    wanted: set[str] | None = None, weights: bool = True, optimizer: bool = True) -> FullState:
    """Full tensors of the ``wanted`` canonical names (all when None) from an old checkpoint.

    ``metas``: old rank -> its JSON; ``load(file name)`` returns a verified file's tensors."""
    params: dict[str, FullParam] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for pp in range(dims.pp):
        head = metas[dims.rank_of(pp, 0, 0)]["shards"]
        names = [n for n in head["tp"] if wanted is None or n in wanted]
        names = [n for n in names if n not in params]  # a tied weight: the first stage's copy
        split = head["tp"]
        # persistent buffers (an MoE router's bias): in the model files only, the same on every TP rank
        buffers = [n for n in dict.fromkeys(head["names"].values())
                   if n not in split and n not in params and (wanted is None or n in wanted)]
        if weights and buffers:
            first = load(model_file(pp, 0))
            live = {canonical: name for name, canonical in head["names"].items()}
            for n in buffers:
                params[n] = FullParam(weight=first[live[n]])
        if not names:
            continue
        if weights and head["kind"] != "zero3":  # ZeRO-3 model files hold placeholders: weights = masters
            files = [load(model_file(pp, t)) for t in range(dims.tp)]
            file_names = {canonical: live for live, canonical in head["names"].items()}
            sliced = head.get("ep", {})  # expert shards: one file per EP rank
            for n in names:
                parts = [experts.read_expert_weight(load, pp, t, dims.ep, file_names[n]) if n in sliced
                         else files[t][file_names[n]] for t in range(dims.tp)]
                params.setdefault(n, FullParam()).weight = _join_tp(parts, split[n])
        if optimizer or head["kind"] == "zero3":
            _read_optimizer(metas, dims, pp, set(names), load, params, scalars)
        if head["kind"] == "zero3":
            for n in names:
                params[n].weight = params[n].fp32
    return FullState(params=params, scalars=scalars)


def _read_optimizer(metas: dict[int, dict], dims: ParallelDims, pp: int, names: set[str], load: Callable,
                    params: dict[str, FullParam], scalars: dict[int, dict[str, Any]]) -> None:
    """Fill ``params[name].fp32/state`` for the names of stage ``pp`` from every old rank file."""
    shards: dict[str, dict[str, list[torch.Tensor]]] = {}  # name -> key -> TP shards
    for t in range(dims.tp):
        ranks = [dims.rank_of(pp, d, t) for d in range(dims.dp)]
        tensors = [load(rank_tensor_file(r)) for r in ranks]
        layout = metas[ranks[0]]["shards"]
        scalar_meta = metas[ranks[0]]["optimizer"]["scalars"]
        for i, group in enumerate(layout["groups"]):
            if layout["kind"] in ("zero", "zero3"):
                _read_flat_group(i, group, tensors, names, shards, scalars, per_parameter=layout["kind"] == "zero3")
            else:  # without ZeRO every DP rank holds the same state, but for the expert shards:
                sliced = layout.get("ep", {})  # those of EP rank e are in dp_rank e's file
                for j, (name, shape) in enumerate(group):
                    prefix = f"torch.{i}.{j}."
                    if name not in names:
                        continue
                    for tname, tensor in tensors[0].items():
                        if not tname.startswith(prefix + "state."):
                            continue
                        key = tname[len(prefix) + 6:]
                        if tensor.numel() != torch.Size(shape).numel():
                            scalars.setdefault(i, {})[key] = tensor
                        else:
                            if name in sliced:
                                tensor = experts.join([tensors[e][tname] for e in range(dims.ep)])
                            shards.setdefault(name, {}).setdefault(key, []).append(tensor)
            for sname, value in scalar_meta.items():  # JSON scalars, e.g. a python-int step
                m = re.match(r"^(?:zero|torch)\.(\d+)\.(?:\d+\.)?state\.(.+)$", sname)
                if m:
                    scalars.setdefault(int(m.group(1)), {})[m.group(2)] = value
    split = metas[dims.rank_of(pp, 0, 0)]["shards"]["tp"]
    for name in names:
        params.setdefault(name, FullParam())
    for name, by_key in shards.items():
        for key, parts in by_key.items():
            full = _join_tp(parts, split[name])
            if key == "fp32":
                params[name].fp32 = full
            else:
                params[name].state[key] = full
    for name in names:  # without ZeRO the weight is its own master copy
        if params.get(name) is not None and params[name].fp32 is None and params[name].weight is not None:
            params[name].fp32 = params[name].weight.float()


def _read_flat_group(i: int, group: dict, tensors: list[dict[str, torch.Tensor]], names: set[str],
                     shards: dict[str, dict[str, list[torch.Tensor]]], scalars: dict[int, dict[str, Any]],
                     per_parameter: bool) -> None:
    """One ZeRO group of one TP shard, from its DP ranks' flat tensors (``tensors``, in DP order).
    ZeRO-1/2: the ranks' slices concatenated are the group's flat buffer, a parameter sits at its
    offset. ZeRO-3 (``per_parameter``): rank d holds elements [d*ps, (d+1)*ps) of each flattened,
    padded parameter, at the parameter's offset in the rank's own flat tensor."""
    prefix = f"zero.{i}."
    keys = ["fp32"] + sorted({k[len(prefix) + 6:] for k in tensors[0] if k.startswith(prefix + "state.")})
    for key in keys:
        parts = [ts[prefix + ("fp32" if key == "fp32" else f"state.{key}")].reshape(-1) for ts in tensors]
        if key != "fp32" and parts[0].numel() != group["numel"]:  # a scalar (LAMB's step)
            scalars.setdefault(i, {})[key] = parts[0].reshape(())
            continue
        flat = None if per_parameter else torch.cat(parts)
        for name, offset, size, shape in group["params"]:
            if name in names:
                if per_parameter:
                    piece = torch.cat([part[offset:offset + size] for part in parts])[:torch.Size(shape).numel()]
                else:
                    piece = flat[offset:offset + size]
                shards.setdefault(name, {}).setdefault(key, []).append(piece.view(shape))


def _apply_zero3(optimizer: Any, full: FullState, names: dict[int, str], local: Callable, groups: ProcessGroups) -> None:
    """This DP rank's slice of each parameter into its ZeRO-3 fp32 partition and moments."""
    base, dp, r = optimizer.optimizer, groups.dims.dp, groups.dp_rank
    for i, (flat, params) in enumerate(zip(state.fp32_partitions(optimizer), optimizer.fp16_groups)):
        buffers: dict[str, torch.Tensor] = {}
        offset = 0
        for p in params:
            ps, found = p.partition_numel(), full.params[names[id(p)]]
            for key, value in [("fp32", found.fp32), *found.state.items()]:
                whole = local(p, value).reshape(-1)
                padded = torch.zeros(ps * dp, dtype=value.dtype)
                padded[:whole.numel()] = whole
                buffers.setdefault(key, torch.zeros(flat.numel(), dtype=value.dtype))[offset:offset + ps] = padded[r * ps:(r + 1) * ps]
            offset += ps
        state._copy_exact(flat, buffers.pop("fp32").to(flat.device), f"zero.{i}.fp32")
        slot = base.state[flat]
        for key, buf in buffers.items():
            _set_state(slot, key, buf.to(flat.device))
        for key, value in full.scalars.get(i, {}).items():
            _set_state(slot, key, value)
    state.sync_zero3_weights(optimizer)


# ---- applying: full tensors -> this rank's shards ---------------------------------------------


def apply_full_state(module: nn.Module, optimizer: Any, full: FullState, groups: ProcessGroups,
                     weights: bool = True) -> None:
    """Copy this rank's TP shard / ZeRO slice of every full tensor into the live run, in place."""
    names = param_names(module)
    tp_rank, tp = groups.tp_rank, groups.dims.tp

    def local(p: torch.Tensor, full_tensor: torch.Tensor) -> torch.Tensor:
        return _cut_tp(experts.cut(p, full_tensor, names[id(p)]), _tp_split(p), tp_rank, tp)

    zero3 = state._is_zero3(optimizer)
    if weights:
        live = state.model_tensors(module)
        # ZeRO-3: the parameters are placeholders, their weights the partitions (below); buffers are whole
        placeholders = {name for name, _ in module.named_parameters()} if zero3 else set()
        for live_name, canonical in canonical_names(module).items():
            if live_name in placeholders:
                continue
            found = full.params.get(canonical)
            if found is None or found.weight is None:
                raise ValueError(f"{canonical}: not in the checkpoint (a different model?)")
            state._copy_exact(live[live_name], _local_like(live[live_name], found.weight, live_name, module, tp_rank, tp), canonical)
    if zero3:
        _apply_zero3(optimizer, full, names, local, groups)
    elif state._is_zero(optimizer):
        base = optimizer.optimizer
        for i, (flat, params, part) in enumerate(_zero_groups(optimizer)):
            start = groups.dp_rank * part.numel()
            buffers: dict[str, torch.Tensor] = {}
            for p in params:
                found = full.params[names[id(p)]]
                offset = _offset(p, flat)
                for key, value in [("fp32", found.fp32), *found.state.items()]:
                    buf = buffers.setdefault(key, torch.zeros(flat.numel(), dtype=value.dtype))
                    buf[offset:offset + p.numel()] = local(p, value).reshape(-1)
            state._copy_exact(part, buffers.pop("fp32")[start:start + part.numel()].to(part.device), f"zero.{i}.fp32")
            slot = base.state[base.param_groups[i]["params"][0]]
            for key, buf in buffers.items():
                _set_state(slot, key, buf[start:start + part.numel()].to(part.device))
            for key, value in full.scalars.get(i, {}).items():
                _set_state(slot, key, value)
        if hasattr(optimizer, "_link_all_hp_params"):
            optimizer._link_all_hp_params()
    else:
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                found = full.params[names[id(p)]]
                for key, value in found.state.items():
                    _set_state(optimizer.state[p], key, local(p, value).to(p.device))
                for key, value in full.scalars.get(i, {}).items():
                    _set_state(optimizer.state[p], key, value)


def _local_like(live: torch.Tensor, full_tensor: torch.Tensor, live_name: str, module: nn.Module,
                tp_rank: int, tp: int) -> torch.Tensor:
    """The shard of ``full_tensor`` that the live tensor ``live_name`` holds."""
    param = dict(module.named_parameters()).get(live_name)
    split = _tp_split(param) if param is not None else None
    return _cut_tp(experts.cut(param, full_tensor, live_name), split, tp_rank, tp).to(live.dtype)


def _set_state(slot: dict, key: str, value: Any) -> None:
    if torch.is_tensor(value):
        if key in slot and torch.is_tensor(slot[key]) and slot[key].shape == value.shape:
            with torch.no_grad():
                slot[key].copy_(value)
        else:
            slot[key] = value.clone()
    else:
        slot[key] = value


# ---- the whole restore at a new layout --------------------------------------------------------


def read_metas(read: Callable[[str], bytes], manifest: dict[str, Any], groups: ProcessGroups) -> dict[int, dict]:
    """Every old rank's JSON: read by rank 0, broadcast to all."""
    dims = old_dims(manifest)
    metas: Any = None
    if groups.rank == 0:
        try:
            metas = {r: json.loads(read(rank_meta_file(r))) for r in range(dims.world_size)}
            missing = [r for r, m in metas.items() if "shards" not in m]
            if missing:
                metas = f"rank files {missing[:3]} carry no parameter map (written before resharding existed): " \
                        f"restore at their own layout {manifest['layout']}"
        except Exception as exc:  # every rank must learn of it, or they wait in the broadcast
            metas = f"{type(exc).__name__}: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [metas]
        dist.broadcast_object_list(box, src=0)
        metas = box[0]
    if isinstance(metas, str):
        raise ValueError(metas)
    return {int(r): m for r, m in metas.items()}


@dataclass
class Loaded:
    full: FullState
    weights: bool  # this rank read the weights (dp_rank 0 of its new shard; under EP the first of its EDP group)
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None  # the old rank with this global rank's


def read_resharded(engine: Any, read: Callable[[str], bytes], metas: dict[int, dict], manifest: dict[str, Any],
                   groups: ProcessGroups) -> Loaded:
    """Read (no collective: a failure here is gathered by the caller) what this rank needs of a
    checkpoint written at another layout. ``read(name)`` returns a file's verified bytes."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def load(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            cache[name] = load_safetensors(read(name))
        return cache[name]

    dims = old_dims(manifest)
    old_kind = metas[0]["shards"]["kind"]
    # weights: one reader per new (pp, tp) shard (and per EDP group: its experts), then broadcast;
    # without ZeRO the old weights are also the fp32 master weights, which every rank needs
    reader = groups.dp_rank < groups.dims.ep
    wanted = set(canonical_names(engine.module).values())
    full = read_full_state(metas, dims, load, wanted, weights=reader or old_kind == "torch", optimizer=True)
    mine = metas.get(groups.rank)
    rng = (load(rank_tensor_file(groups.rank)), mine["rng"]) if mine is not None and "rng" in mine else None
    return Loaded(full=full, weights=reader, rng=rng)


def apply_resharded(engine: Any, loaded: Loaded, groups: ProcessGroups) -> None:
    """Put what ``read_resharded`` read into this rank, in place, and share the weights over DP."""
    apply_full_state(engine.module, engine.optimizer, loaded.full, groups, weights=loaded.weights)
    experts.broadcast_weights(engine.module, groups)
    log.info("resharded into dp=%d tp=%d pp=%d ep=%d", groups.dims.dp, groups.dims.tp, groups.dims.pp, groups.dims.ep)
