"""Restore: the newest committed checkpoint whose files verify, read once per group, broadcast.

1. Global rank 0 lists the committed checkpoints (newest first) and checks that their config
   fingerprint and parallel layout match this run; a mismatch is an error, not a fallback (the
   durable URL belongs to another run). It broadcasts the candidates to all ranks.
2. For a candidate, every rank reads the files it needs and checks each file's size and sha256
   against the manifest while it is in memory (a checkpoint is data: safetensors + JSON, never
   pickle). The union of those reads is every file of the checkpoint, so every file is verified,
   and no byte is read twice. All ranks exchange their verdicts; if any rank found a problem, the
   reasons are logged and all ranks move on to the previous checkpoint.
3. Who reads what (MegaScale's "one reader per group, then broadcast"): model weights are the same
   on every data-parallel replica, so only dp_rank 0 of each (pp, tp) shard reads the model file
   and broadcasts the tensors over its DP group; optimizer state under ZeRO is a different
   partition on each DP rank, so each rank reads its own rank file (there is nothing to share).
4. Everything is put back in place: model, optimizer partition and hyper-parameters, LR schedule,
   DeepSpeed's step counters, data-loader position and, last, the RNG states, so the next step is
   bit-identical to the one an uninterrupted run would take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatrain import storage
from megatrain.checkpoint import catalog, state
from megatrain.checkpoint.files import (
    ChecksumError, check_bytes, check_parses, model_file, parse_json, parse_safetensors, rank_meta_file,
    rank_tensor_file, sha256_stream,
)
from megatrain.parallel.dims import ProcessGroups

log = logging.getLogger("megatrain.checkpoint")


class CheckpointError(RuntimeError):
    """No checkpoint can be restored although committed ones exist, or they belong to another run."""


class CheckpointMismatch(CheckpointError):
    """A committed checkpoint was written by a different config or parallel layout."""


def check_compatible(manifest: dict[str, Any], fingerprint: str, layout: dict[str, int], url: str) -> None:
    if manifest.get("fingerprint") != fingerprint:
        raise CheckpointMismatch(
            f"{url}: written by a different config (fingerprint {manifest.get('fingerprint')} != this run's "
            f"{fingerprint}); use another checkpoint.durable_url, or checkpoint.resume=false to start over"
        )
    saved = {k: manifest.get("layout", {}).get(k) for k in layout}
    if saved != layout:
        raise CheckpointMismatch(f"{url}: saved with layout {saved}, this run is {layout}; resharding is not supported")


def read_verified(step_url: str, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a committed step, after checking size and sha256."""
    files = catalog.manifest_files(step_url, manifest)  # every name confined to the step dir
    if name not in files:
        raise ChecksumError(f"{name}: not listed in the manifest of {step_url}")
    url, record = files[name]
    data = storage.read_bytes(url)
    check_bytes(data, record, url)
    return data


@dataclass
class RankState:
    """What one rank read for one checkpoint."""

    model: dict[str, torch.Tensor] | None  # only on the rank that reads its shard's model file
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def read_rank_state(step_url: str, manifest: dict[str, Any], groups: ProcessGroups) -> RankState:
    """Read and verify this rank's files (and its shard's model file when it is the DP reader)."""
    rank = groups.rank
    model = None
    if groups.dp_rank == 0:
        name = model_file(groups.pp_rank, groups.tp_rank)
        model = parse_safetensors(read_verified(step_url, name, manifest), name)
    tensors = parse_safetensors(read_verified(step_url, rank_tensor_file(rank), manifest), rank_tensor_file(rank))
    meta = parse_json(read_verified(step_url, rank_meta_file(rank), manifest), rank_meta_file(rank))
    if not isinstance(meta, dict) or meta.get("step") != manifest["step"] or meta.get("rank") != rank:
        raise ChecksumError(f"{rank_meta_file(rank)}: records step {meta.get('step')} rank {meta.get('rank')}")
    return RankState(model=model, tensors=tensors, meta=meta)


def verify_checkpoint(step_url: str, manifest: dict[str, Any]) -> list[str]:
    """Check size and sha256 of every file of a committed step (streamed), and that each parses
    (JSON, or a safetensors header); returns the problems. A name that would leave the step
    directory is a problem, and nothing is read under it."""
    try:
        files = catalog.manifest_files(step_url, manifest)
    except ValueError as exc:  # UnsafePathError included
        return [str(exc)]
    problems = []
    for name, (url, record) in sorted(files.items()):
        try:
            with storage.open_url(url) as handle:
                actual = sha256_stream(handle)
            if actual != record:
                problems.append(f"{url}: size {actual.size} sha256 {actual.sha256[:16]}... != manifest "
                                f"size {record.size} sha256 {record.sha256[:16]}...")
            else:
                check_parses(url, name)
        except (OSError, ChecksumError) as exc:
            problems.append(str(exc))
    return problems


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast_from_rank0(value: Any) -> Any:
    box = [value]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if _world() == 1:
        return [value]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _candidates(durable_url: str, fingerprint: str | None, layout: dict[str, int]) -> list[tuple[int, str, dict]]:
    infos = list(reversed(catalog.list_checkpoints(durable_url)))
    for info in infos:
        if info.problem:
            log.warning("checkpoint %s ignored: %s", info.url, info.problem)
    found = [(info.step, info.url, info.manifest) for info in infos if info.committed]
    for _, url, manifest in found:
        check_compatible(manifest, fingerprint or manifest.get("fingerprint"), layout, url)
    return found


def restore_checkpoint(trainer: Any, durable_url: str, fingerprint: str | None, layout: dict[str, int],
                       groups: ProcessGroups, full: bool = True) -> int | None:
    """Put the newest verified committed checkpoint under ``durable_url`` into ``trainer``.

    Returns its step, or None when the URL holds no committed checkpoint. ``fingerprint=None``
    accepts any config of the same layout (a campaign stage starting from the previous stage);
    ``full=False`` puts back only model and optimizer tensors (see ``apply_rank_state``).
    """
    found: Any = None
    if groups.rank == 0:
        try:
            found = ("ok", _candidates(durable_url, fingerprint, layout))
        except Exception as exc:  # every rank must learn of the failure, or they wait forever below
            found = ("error", f"{type(exc).__name__}: {exc}", isinstance(exc, CheckpointMismatch))
    found = _broadcast_from_rank0(found)
    if found[0] == "error":
        raise (CheckpointMismatch if found[2] else CheckpointError)(found[1])
    candidates = found[1]
    for step, url, manifest in candidates:
        try:
            rank_state, problem = read_rank_state(url, manifest, groups), None
        except (ChecksumError, OSError, ValueError, KeyError) as exc:
            rank_state, problem = None, f"{type(exc).__name__}: {exc}"
        problems = [(r, p) for r, p in enumerate(_gather(problem)) if p]
        if problems:
            reasons = "; ".join(f"rank {r}: {p}" for r, p in problems)
            log.warning("checkpoint %s rejected, falling back to the one before: %s", url, reasons)
            continue
        apply_rank_state(trainer, rank_state, groups, full=full)
        log.info("restored checkpoint %s (step %d%s)", url, step, "" if full else ", weights and optimizer only")
        return step
    if candidates:
        raise CheckpointError(
            f"{durable_url}: {len(candidates)} committed checkpoint(s), none verified (reasons above); "
            "repair or remove them, or set checkpoint.resume=false"
        )
    return None


def newest_restorable_step(durable_url: str) -> int | None:
    """The step restore would pick: the newest committed checkpoint whose every file verifies
    (read in full; a rollback decision is worth it). None when there is none."""
    for info in reversed(catalog.committed(durable_url)):
        problems = verify_checkpoint(info.url, info.manifest)
        if not problems:
            return info.step
        log.warning("checkpoint %s does not verify: %s", info.url, "; ".join(problems))
    return None


def _broadcast_model(module: torch.nn.Module, groups: ProcessGroups) -> None:
    """dp_rank 0 of this (pp, tp) shard sends its weights to the other DP replicas."""
    if groups.dims.dp == 1 or not dist.is_initialized():
        return
    src = groups.dims.rank_of(groups.pp_rank, 0, groups.tp_rank)
    with torch.no_grad():
        for tensor in state.model_tensors(module).values():
            dist.broadcast(tensor, src=src, group=groups.dp_group)


def apply_rank_state(trainer: Any, rank_state: RankState, groups: ProcessGroups, full: bool = True) -> None:
    """Put what a rank read back in place. ``full=False`` (a new campaign stage): model weights and
    optimizer tensors only; the stage keeps its own LR schedule, hyper-parameters, step count,
    data position and seeds."""
    engine, meta = trainer.engine, rank_state.meta
    if rank_state.model is not None:
        state.load_model_tensors(engine.module, rank_state.model)
    _broadcast_model(engine.module, groups)
    state.load_optimizer_state(engine.optimizer, rank_state.tensors, meta["optimizer"], hyperparameters=full)
    if not full:
        return
    if meta.get("scheduler") is not None and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    state.load_engine_counters(engine, meta.get("engine", {}))
    if meta.get("loader") is not None:
        trainer.loader.load_state_dict(meta["loader"])
    state.load_rng_state(trainer.env.device, rank_state.tensors, meta["rng"])  # last: nothing may draw after it
