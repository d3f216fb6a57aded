"""Restore: the newest committed checkpoint whose files verify, read once per group, broadcast.

1. Global rank 0 lists the committed checkpoints (newest first) and checks that this run can
   continue them: the fields that define the model, optimizer, data and seed must match
   (``compat.state_fields``), the batch size and optimizer hyper-parameters too unless
   ``checkpoint.allow_schedule_change`` (``compat.schedule_fields``). The LR schedule is judged
   as a function of the step, not by its fields (``optim/schedule.py``): this run must give the
   steps the checkpoint's run trained the LRs they had, and the steps to come the LRs of the
   checkpoint's schedule at this run's length, or ask for an explicit transition
   (``checkpoint.resume_lr``). A mismatch is an error naming each field or the first step whose
   LR differs, not a fallback. It broadcasts the candidates to all ranks. A checkpoint written at
   another parallel layout is resharded (reshard.py) instead of read as below.
2. For a candidate, every rank reads the files it needs and checks each file's size and sha256
   against the manifest while it is in memory (a checkpoint is data: safetensors + JSON, never
   pickle). The union of those reads is every file of the checkpoint, so every file is verified,
   and no byte is read twice. All ranks exchange their verdicts; if any rank found a problem, the
   reasons are logged and all ranks move on to the previous checkpoint.
3. Who reads what (MegaScale's "one reader per group, then broadcast"): model weights are the same
   on every data-parallel replica, so only dp_rank 0 of each (pp, tp) shard reads the model file
   and broadcasts the tensors over its DP group (under expert parallelism the first rank of each
   EDP group also reads its slice of the experts and broadcasts it over that group: experts.py);
   optimizer state under ZeRO is a different partition on each DP rank, so each rank reads its
   own rank file (there is nothing to share).
4. Everything is put back in place: the data-loader position first (a position of another
   order or mixture is refused before anything changed), model, optimizer partition and
   hyper-parameters, LR schedule (with the restarts the checkpoint's run had), DeepSpeed's step
   counters, the anomaly detector's windows and, last, the RNG states, so the next step is
   bit-identical to the one an uninterrupted run would take.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatrain import storage
from megatrain.checkpoint import catalog, experts, reshard, state
from megatrain.config import compat
from megatrain.checkpoint.files import (
    ChecksumError, check_bytes, check_parses, parse_json, rank_meta_file, rank_tensor_file, read_safetensors_verified,
    sha256_stream,
)
from megatrain.checkpoint.continuity import (  # noqa: F401  (re-exported: the restore's errors and checks)
    CheckpointError, CheckpointMismatch, LRResume, RunIdentity, StageStart, _differences, check_compatible,
    check_loader, check_tokenizer, judge_lr, restore_schedule,
)
from megatrain.checkpoint.names import live_names
from megatrain.observe.laps import Laps
from megatrain.parallel.dims import ProcessGroups

log = logging.getLogger("megatrain.checkpoint")


def same_layout(saved: dict[str, Any], mine: dict[str, Any]) -> bool:
    """True when every rank's files fit this run as they are (no resharding)."""
    keys = ("dp", "tp", "pp", "world_size")
    if any(saved.get(k) != mine.get(k) for k in keys) or saved.get("ep", 1) != mine.get("ep", 1):
        return False
    if "zero_stage" in saved and "zero_stage" in mine:  # ZeRO 1 and 2 share a partition layout; 0 and 3 do not
        return _partitioning(saved["zero_stage"]) == _partitioning(mine["zero_stage"])
    return True


def _partitioning(zero_stage: int) -> str:
    return {0: "none", 1: "flat", 2: "flat", 3: "per-parameter"}[zero_stage]


def read_verified(step_url: str, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of one file of a committed step, after checking size and sha256."""
    files = catalog.manifest_files(step_url, manifest)  # every name confined to the step dir
    if name not in files:
        raise ChecksumError(f"{name}: not listed in the manifest of {step_url}")
    url, record = files[name]
    data = storage.read_bytes(url)
    check_bytes(data, record, url)
    return data


def read_verified_tensors(step_url: str, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file of a committed step, after checking size and sha256
    (streamed into one buffer, hashed while read; the tensors are views into it: files.py)."""
    files = catalog.manifest_files(step_url, manifest)
    if name not in files:
        raise ChecksumError(f"{name}: not listed in the manifest of {step_url}")
    url, record = files[name]
    return read_safetensors_verified(url, record, url)


@dataclass
class RankState:
    """What one rank read for one checkpoint."""

    model: dict[str, torch.Tensor] | None  # only on a rank that reads model files (experts.weight_files)
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def read_rank_state(step_url: str, manifest: dict[str, Any], groups: ProcessGroups) -> RankState:
    """Read and verify this rank's files (and its shard's model files when it is their reader)."""
    rank = groups.rank
    model = experts.read_weights(groups, lambda name: read_verified_tensors(step_url, name, manifest))
    tensors = read_verified_tensors(step_url, rank_tensor_file(rank), manifest)
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


@dataclass
class Candidate:
    step: int
    url: str
    manifest: dict[str, Any]
    schedule_changes: dict[str, list]  # field -> [checkpoint's, this run's] (allowed by the flag)
    history: list[dict]  # the checkpoint's record of earlier changes
    last_lr: float | None = None  # the LR the checkpoint's run used at its step (its scheduler state)
    lr: LRResume = LRResume()  # how this run's LR schedule continues the checkpoint's

    @property
    def hyperparameters_changed(self) -> bool:
        """Schedule fields other than the LR's changed (flag), or the LR jumps: this run's values."""
        fixed = any(k not in compat.LR_SCHEDULE_FIELDS for k in self.schedule_changes)
        return fixed or self.lr.jump


def _candidates(durable_url: str, identity: RunIdentity | None, tokenizer_sha256: str | None,
                stage: StageStart | None = None) -> list[Candidate]:
    """Committed checkpoints, newest first, after checking that this run can continue each one
    (``identity``; None: any config, within what ``stage`` allows) and that it trained on this
    run's tokenizer. The stage's change is said once, in one line (rank 0's log)."""
    said = False
    infos = list(reversed(catalog.list_checkpoints(durable_url)))
    for info in infos:
        if info.problem:
            log.warning("checkpoint %s ignored: %s", info.url, info.problem)
    found = []
    for info in (i for i in infos if i.committed):
        meta0 = None
        if identity is None or info.manifest.get("fingerprint") != identity.fingerprint or tokenizer_sha256:
            try:  # a small JSON, verified; unreadable means "cannot tell", a mismatch for old files
                meta0 = parse_json(read_verified(info.url, rank_meta_file(0), info.manifest), rank_meta_file(0))
            except (ChecksumError, OSError, ValueError) as exc:
                log.warning("checkpoint %s: rank 0's JSON unreadable (%s)", info.url, exc)
        check_tokenizer(meta0, tokenizer_sha256, info.url)
        change = stage.judge(meta0, info.url) if stage is not None else None
        if change is not None and change.line and not said:
            log.info("%s", change.line)
            said = True
        changes = {} if identity is None else check_compatible(info.manifest, meta0, identity, info.url)
        lr = LRResume() if identity is None or info.manifest.get("fingerprint") == identity.fingerprint \
            else judge_lr(meta0, identity, info.url)  # one fingerprint: one config, one schedule
        history = (meta0 or {}).get("history", [])
        last_lr = ((meta0 or {}).get("scheduler") or {}).get("_last_lr") or [None]
        found.append(Candidate(info.step, info.url, info.manifest, changes, history, last_lr[0], lr))
    return found


@dataclass
class Restored:
    step: int
    history: list[dict]  # the checkpoint's history plus what this restore changed


def restore_checkpoint(trainer: Any, durable_url: str, identity: RunIdentity | None, layout: dict[str, int],
                       groups: ProcessGroups, full: bool = True, tokenizer_sha256: str | None = None,
                       stage: StageStart | None = None) -> Restored | None:
    """Put the newest verified committed checkpoint under ``durable_url`` into ``trainer``.

    Returns its step and history, or None when the URL holds no committed checkpoint.
    ``identity=None`` accepts any config (a campaign stage starting from the previous stage);
    ``full=False`` puts back only model and optimizer tensors (see ``apply_rank_state``);
    ``tokenizer_sha256``: refuse a checkpoint trained on another tokenizer's data; ``stage``: a
    run starting from another's checkpoint, refused when it changes the model's shapes. A
    checkpoint written at another layout (dp, tp, pp, ZeRO or not) is resharded (reshard.py).
    """
    found: Any = None
    if groups.rank == 0:
        try:
            found = ("ok", _candidates(durable_url, identity, tokenizer_sha256, stage))
        except Exception as exc:  # every rank must learn of the failure, or they wait forever below
            mismatch = isinstance(exc, CheckpointMismatch)
            found = ("error", str(exc) if mismatch else f"{type(exc).__name__}: {exc}", mismatch)
    found = _broadcast_from_rank0(found)
    if found[0] == "error":
        raise (CheckpointMismatch if found[2] else CheckpointError)(found[1])
    candidates: list[Candidate] = found[1]
    for c in candidates:
        apply = _read_same_layout if same_layout(c.manifest["layout"], layout) else _read_other_layout
        try:
            put_back, problem = apply(trainer, c, groups), None
        except (ChecksumError, OSError, ValueError, KeyError) as exc:
            put_back, problem = None, f"{type(exc).__name__}: {exc}"
        problems = [(r, p) for r, p in enumerate(_gather(problem)) if p]
        if problems:
            reasons = "; ".join(f"rank {r}: {p}" for r, p in problems)
            log.warning("checkpoint %s rejected, falling back to the one before: %s", c.url, reasons)
            continue
        put_back(full, c.hyperparameters_changed, c.lr.restarts)
        log.info("restored checkpoint %s (step %d%s)", c.url, c.step, "" if full else ", weights and optimizer only")
        return Restored(c.step, c.history + _changes(c, layout, trainer, announce=groups.rank == 0))
    if candidates:
        raise CheckpointError(
            f"{durable_url}: {len(candidates)} committed checkpoint(s), none verified (reasons above); "
            "repair or remove them, or set checkpoint.resume=false"
        )
    return None


def _changes(c: Candidate, layout: dict[str, int], trainer: Any, announce: bool) -> list[dict]:
    """This restore's entry of the checkpoint history (none when nothing changed). A schedule
    change records the LR at the resume step under the checkpoint's schedule and under this run's
    (an extended cosine run, for one, jumps back up), and says so in the log."""
    entry: dict[str, Any] = {}
    if c.schedule_changes or c.lr.changed:
        if c.schedule_changes:
            entry["schedule"] = c.schedule_changes
        scheduler = getattr(trainer.engine, "lr_scheduler", None)
        now = scheduler.get_last_lr()[0] if scheduler is not None else None
        entry["lr"] = [c.last_lr, now]
        if c.lr.restarts:
            entry["lr_restart"] = c.lr.restarts[-1]
            if announce:
                restart = c.lr.restarts[-1]
                log.warning("resuming step %d with checkpoint.resume_lr=%s: %s; from LR %.3e%s", c.step,
                            restart["mode"], c.lr.difference.describe() if c.lr.difference else "",
                            restart["from_lr"], f" back to the schedule over {restart['steps']} steps"
                            if restart["mode"] == "rewarm" else " down to optim.min_lr by train.steps")
        elif announce and c.last_lr is not None and now is not None:
            log.warning("resuming step %d with a changed schedule: the LR goes from %.3e (the checkpoint's run) to "
                        "%.3e (this run's schedule at that step)", c.step, c.last_lr, now)
    saved = c.manifest["layout"]
    if not same_layout(saved, layout) or saved.get("zero_stage", layout.get("zero_stage")) != layout.get("zero_stage"):
        entry["layout"] = [saved, layout]
    return [{"step": c.step, **entry}] if entry else []


def _read_same_layout(trainer: Any, c: Candidate, groups: ProcessGroups):
    """Read this rank's own files; returns the function that puts them in place."""
    rank_state = read_rank_state(c.url, c.manifest, groups)
    return lambda full, schedule_changed, lr_restarts: apply_rank_state(trainer, rank_state, groups, full,
                                                                        schedule_changed, lr_restarts=lr_restarts)


def _read_other_layout(trainer: Any, c: Candidate, groups: ProcessGroups):
    """Read what this rank needs of a checkpoint written at another layout (reshard.py)."""
    def read(name: str) -> bytes:
        return read_verified(c.url, name, c.manifest)

    metas = reshard.read_metas(read, c.manifest, groups)
    loaded = reshard.read_resharded(trainer.engine, read, metas, c.manifest, groups)

    def put_back(full: bool, schedule_changed: bool, lr_restarts: list[dict] | None) -> None:
        meta0 = metas[0]
        if full:
            check_loader(trainer, meta0)
        reshard.apply_resharded(trainer.engine, loaded, groups)
        if full and not schedule_changed:
            state.load_hyperparameters(trainer.engine.optimizer, meta0["optimizer"]["param_groups"])
        if full:
            _apply_run_state(trainer, meta0, schedule_changed, loaded.rng, lr_restarts)
    return put_back


def newest_restorable_step(durable_url: str) -> int | None:
    """The step restore would pick: the newest committed checkpoint whose every file verifies
    (read in full; a rollback decision is worth it). None when there is none."""
    for info in reversed(catalog.committed(durable_url)):
        problems = verify_checkpoint(info.url, info.manifest)
        if not problems:
            return info.step
        log.warning("checkpoint %s does not verify: %s", info.url, "; ".join(problems))
    return None


def apply_rank_state(trainer: Any, rank_state: RankState, groups: ProcessGroups, full: bool = True,
                     schedule_changed: bool = False, seconds: dict[str, float] | None = None,
                     lr_restarts: list[dict] | None = None) -> None:
    """Put what a rank read back in place. ``full=False`` (a new campaign stage): model weights and
    optimizer tensors only; the stage keeps its own LR schedule, hyper-parameters, step count,
    data position and seeds. ``schedule_changed``: keep this run's LR schedule and hyper-parameters
    (only the step count of the schedule comes from the checkpoint). ``lr_restarts``: the LR
    schedule's restarts from now on (``judge_lr``; None: the checkpoint's). ``seconds``: gets each
    part's time."""
    engine, meta = trainer.engine, rank_state.meta
    if full:
        check_loader(trainer, meta)
    param = next(engine.module.parameters(), None)
    clock = Laps(seconds, cuda=param is not None and param.is_cuda)
    if rank_state.model is not None:
        state.load_model_tensors(engine.module, live_names(rank_state.model, meta, engine.module),
                                 names=experts.names_read(engine.module, groups))
    experts.broadcast_weights(engine.module, groups)
    clock.lap("model")
    state.load_optimizer_state(engine.optimizer, rank_state.tensors, meta["optimizer"],
                               hyperparameters=full and not schedule_changed)
    clock.lap("optimizer")
    if full:
        _apply_run_state(trainer, meta, schedule_changed, (rank_state.tensors, meta["rng"]), lr_restarts)
        clock.lap("run_state")


def _apply_run_state(trainer: Any, meta: dict[str, Any], schedule_changed: bool, rng: tuple | None,
                     lr_restarts: list[dict] | None = None) -> None:
    """Schedule, DeepSpeed's counters, the anomaly windows and (last: nothing may draw after it) RNG."""
    engine = trainer.engine
    scheduler = getattr(engine, "lr_scheduler", None)
    if meta.get("scheduler") is not None and scheduler is not None:
        restore_schedule(scheduler, meta, schedule_changed, lr_restarts)
    state.load_engine_counters(engine, meta.get("engine", {}))
    if hasattr(engine, "gradient_accumulation_steps"):  # the micro-batch split may have changed
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    detector = getattr(trainer, "anomaly", None)
    if detector is not None and hasattr(detector, "load_state_dict"):
        detector.load_state_dict(meta.get("anomaly"))
    if rng is not None:
        state.load_rng_state(trainer.env.device, *rng)
