"""Whether, and how, a run continues a checkpoint: a resume is exact or refused.

Every restored part that moves from step to step is checked as what it does, not by the fields
that configured it:

- the model, optimizer kind, data and seeds (``compat.state_fields``) and the batch size and
  optimizer hyper-parameters (``compat.schedule_fields``, these with
  ``checkpoint.allow_schedule_change``) by value: a difference is named field by field;
- the LR schedule as a function of the step (``judge_lr`` over ``optim/schedule.py``): this run
  must give every step the checkpoint's run trained the LR it had and every step to come the LR
  of the checkpoint's schedule at this run's length. Otherwise the resume is refused, naming the
  step where the two part (a WSD decay that began), unless ``checkpoint.resume_lr`` asks for a
  continuous transition (``redecay``, ``rewarm``), recorded as a restart of the schedule that
  every later resume keeps (``restore_schedule``);
- the data position (``check_loader``): put back first, so a position of another shard version,
  mixture, seed or shuffle window is refused before any tensor has changed;
- the anomaly detector's windows come back with the run state (``reliability/anomaly.py`` says
  when they cannot: another window configuration starts them empty, in one line).

There is no loss scaler to restore: ``train.dtype`` is bf16 or fp32, whose scale is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain import errors
from megatrain.config import compat, stage_change
from megatrain.optim.schedule import RESTART_MODES, Difference, Schedule, resume_difference, same_lr


class CheckpointError(RuntimeError):
    """No checkpoint can be restored although committed ones exist, or they belong to another run."""


class CheckpointMismatch(CheckpointError, errors.CheckpointMismatch):
    """A committed checkpoint that this run cannot continue: a model-defining field differs, or a
    schedule field without ``checkpoint.allow_schedule_change`` (deterministic: no restart)."""


@dataclass(frozen=True)
class RunIdentity:
    """What this run must share with a checkpoint to continue it (see ``compat.state_fields``)."""

    fingerprint: str
    state: dict[str, Any]
    schedule: dict[str, Any]
    allow_schedule_change: bool = False
    tokenizer_sha256: str | None = None  # of the data this run trains on: token ids mean text only under it
    lr_schedule: dict[str, Any] | None = None  # this run's Schedule (its record); None: no LR check
    resume_lr: str = "exact"  # checkpoint.resume_lr: exact | redecay | rewarm
    rewarm_steps: int = 1

    @classmethod
    def of(cls, cfg: Any, tokenizer_sha256: str | None = None) -> RunIdentity:
        ckpt = cfg.checkpoint
        return cls(compat.fingerprint(cfg), compat.state_fields(cfg), compat.schedule_fields(cfg),
                   ckpt.allow_schedule_change, tokenizer_sha256, Schedule.of(cfg.optim, cfg.train.steps).record(),
                   ckpt.resume_lr, ckpt.rewarm_steps or max(1, cfg.optim.warmup_steps))


@dataclass(frozen=True)
class StageStart:
    """A run starting from another run's checkpoint (``checkpoint.init_from``: a campaign stage
    starting from the previous stage's final one): what it may change is ``config/stage_change.py``'s
    rule, judged against what the checkpoint recorded. The stages are named by their durable URLs'
    last part (a campaign's ``<durable>/<stage>``)."""

    fields: dict[str, Any]  # stage_change.stage_fields of this run
    previous: str
    stage: str

    @classmethod
    def of(cls, cfg: Any) -> StageStart:
        name = lambda url: str(url).rstrip("/").rsplit("/", 1)[-1]  # noqa: E731
        return cls(stage_change.stage_fields(cfg), name(cfg.checkpoint.init_from), name(cfg.checkpoint.durable_url))

    def judge(self, meta0: dict[str, Any] | None, url: str) -> stage_change.StageChange | None:
        """What this run changes of the checkpoint's run; CheckpointMismatch (deterministic) for a
        shape. None: a checkpoint written before checkpoints recorded their fields (not judged)."""
        if meta0 is None or "state_fields" not in meta0:
            return None
        saved = {**meta0["state_fields"], **(meta0.get("layout_fields") or {})}
        change = stage_change.judge(saved, self.fields, self.previous, self.stage)
        if change.refusal:
            raise CheckpointMismatch(f"{url}: {change.refusal}")
        return change


def check_tokenizer(meta0: dict[str, Any] | None, tokenizer_sha256: str | None, url: str) -> None:
    """Refuse a checkpoint trained on data of another tokenizer: its embeddings learned other ids."""
    saved = (meta0 or {}).get("tokenizer_sha256")
    if saved and tokenizer_sha256 and saved != tokenizer_sha256:
        raise CheckpointMismatch(
            f"{url}: trained on data of tokenizer sha256 {saved[:16]}..., this run's data uses tokenizer sha256 "
            f"{tokenizer_sha256[:16]}... (data.tokenizer): the same ids would mean other text; train on the "
            "checkpoint's tokenizer, or start from scratch"
        )


def _differences(saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, list]:
    """Fields whose values differ; a knob added after the checkpoint was written (absent from
    it) had its default then."""
    later = compat.later_knob_defaults()
    old = lambda k: saved[k] if k in saved else later.get(k)  # noqa: E731
    return {k: [old(k), mine.get(k)] for k in sorted(set(saved) | set(mine)) if old(k) != mine.get(k)}


def _describe(diff: dict[str, list]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items())


def check_compatible(manifest: dict[str, Any], meta0: dict[str, Any] | None, identity: RunIdentity,
                     url: str) -> dict[str, list]:
    """Raise CheckpointMismatch when this run cannot continue the checkpoint; returns the schedule
    fields that change (allowed by the flag). ``meta0`` is the checkpoint's rank-0 JSON (needed
    only when the fingerprints differ). The parallel layout never blocks: restore reshards."""
    if manifest.get("fingerprint") == identity.fingerprint:
        return {}
    if meta0 is None or "state_fields" not in meta0:
        raise CheckpointMismatch(
            f"{url}: written by a different config (fingerprint {manifest.get('fingerprint')} != this run's "
            f"{identity.fingerprint}) before checkpoints recorded their fields; use another "
            "checkpoint.durable_url, or checkpoint.resume=false to start over"
        )
    model = _differences(meta0["state_fields"], identity.state)
    if model:
        raise CheckpointMismatch(
            f"{url}: written by a config that differs in fields that define the model, optimizer, data or seed: "
            f"{_describe(model)} (checkpoint -> this run); use another checkpoint.durable_url, or "
            "checkpoint.resume=false to start over"
        )
    schedule = _differences(meta0.get("schedule_fields", {}), identity.schedule)
    fixed = {k: v for k, v in schedule.items() if k not in compat.LR_SCHEDULE_FIELDS}  # the LRs: judge_lr
    if fixed and not identity.allow_schedule_change:
        raise CheckpointMismatch(
            f"{url}: the batch size or optimizer hyper-parameters differ: {_describe(fixed)} (checkpoint -> this "
            "run); set checkpoint.allow_schedule_change=true to continue with the new values (recorded in the "
            "checkpoint history), or keep the old ones"
        )
    return schedule


@dataclass(frozen=True)
class LRResume:
    """How this run's LR schedule continues a checkpoint's (``judge_lr``)."""

    restarts: list[dict] | None = None  # the schedule's restarts from the resume step on; None: the checkpoint's
    jump: bool = False  # checkpoint.allow_schedule_change: this run's schedule as it is, the LR jumps
    difference: Difference | None = None  # the first step at which the two schedules part (None: exact)

    @property
    def changed(self) -> bool:
        return self.restarts is not None or self.jump


def _saved_schedule(meta0: dict[str, Any]) -> tuple[Schedule | None, int | None, float | None]:
    """The checkpoint's LR schedule (None when written before checkpoints recorded it), the step
    its scheduler stands at, and the LR it had there without a rollback's scale."""
    sched = meta0.get("scheduler") or {}
    saved = Schedule.from_record((sched.get("lr_lambdas") or [None])[0])
    step = sched.get("last_epoch")
    if saved is not None and step is not None:
        return saved, step, saved.at(step)
    last, base = (sched.get("_last_lr") or [None])[0], (sched.get("base_lrs") or [None])[0]
    peak = (meta0.get("schedule_fields") or {}).get("optim.lr")
    return None, step, (last * peak / base if last is not None and base and peak else last)


def judge_lr(meta0: dict[str, Any] | None, identity: RunIdentity, url: str) -> LRResume:
    """Whether resuming the checkpoint continues its LR schedule exactly; if not, the transition
    ``checkpoint.resume_lr`` asks for, the jump ``allow_schedule_change`` accepts, or a
    CheckpointMismatch naming the step where the two part and what to set."""
    if meta0 is None or identity.lr_schedule is None:
        return LRResume()
    mine = Schedule.from_record(identity.lr_schedule)
    saved, step, current = _saved_schedule(meta0)
    if step is None or current is None:
        return LRResume()  # a checkpoint without a scheduler: nothing to continue
    if saved is not None:
        difference = resume_difference(saved, mine, step)
    else:  # only the LR at the resume step is known
        this = mine.at(step)
        difference = None if same_lr(current, this) else Difference(step, current, this, trained=False)
    if difference is None:
        return LRResume()
    if identity.resume_lr in RESTART_MODES:
        inherited = mine.with_length(mine.total_steps)
        inherited.restarts = list(saved.restarts) if saved is not None else []
        restarted = inherited.restarted(step, identity.resume_lr, current, identity.rewarm_steps)
        return LRResume(restarts=restarted.restarts, difference=difference)
    fields = {k: v for k, v in _differences(meta0.get("schedule_fields", {}), identity.schedule).items()
              if k in compat.LR_SCHEDULE_FIELDS}
    if identity.allow_schedule_change and fields:
        return LRResume(jump=True, difference=difference)
    raise CheckpointMismatch(_lr_refusal(url, step, current, difference, saved, mine, fields))


def _lr_refusal(url: str, step: int, current: float, difference: Difference, saved: Schedule | None,
                mine: Schedule, fields: dict[str, list]) -> str:
    """One line: where the schedules part, why (a WSD decay that began), and the ways on."""
    why = ""
    decay = saved.decay_start() if saved is not None else None
    if saved is not None and saved.kind == "wsd" and decay is not None and decay <= max(step - 1, difference.step):
        why = f" (its WSD decay began at step {decay}; train.steps {saved.total_steps} -> {mine.total_steps})"
    elif saved is not None and saved.total_steps != mine.total_steps:
        why = f" (train.steps {saved.total_steps} -> {mine.total_steps})"
    if fields:
        why += f" ({_describe(fields)})"
    keep = f"keep train.steps={saved.total_steps}" if saved is not None and saved.total_steps != mine.total_steps \
        else "keep the checkpoint's schedule"
    jump = ", or checkpoint.allow_schedule_change=true to take this run's schedule as it is (the LR jumps)" \
        if fields else ""
    return (f"{url}: resuming at step {step} would not continue its LR schedule: {difference.describe()}{why}; set "
            f"checkpoint.resume_lr=redecay to decay from the current LR {current:.3e} to optim.min_lr by train.steps, "
            f"or checkpoint.resume_lr=rewarm to go back up to this run's schedule over checkpoint.rewarm_steps, or "
            f"{keep}{jump}")


def check_loader(trainer: Any, meta: dict[str, Any]) -> None:
    """Put the data position back first: one of another shard version, mixture, seed or shuffle
    window is refused (deterministic, naming what differs) before any tensor has changed."""
    if meta.get("loader") is None:
        return
    try:
        trainer.loader.load_state_dict(meta["loader"])
    except errors.DeterministicError:
        raise
    except (ValueError, KeyError) as exc:
        raise CheckpointMismatch(f"step {meta.get('step')}: its data position cannot continue this run's data: "
                                 f"{exc}; use another checkpoint.durable_url, or checkpoint.resume=false") from None


def restore_schedule(scheduler: Any, meta: dict[str, Any], schedule_changed: bool,
                      lr_restarts: list[dict] | None) -> None:
    """The checkpoint's scheduler state, under this run's schedule function. Exact (nothing
    changed): the state as saved, and the checkpoint's restarts. Changed (``schedule_changed``, or
    a restart ``judge_lr`` added): this run's schedule at the checkpoint's step, a rollback's LR
    scale of the base LRs kept."""
    saved_state = dict(meta["scheduler"])
    saved = Schedule.from_record((saved_state.get("lr_lambdas") or [None])[0])
    live = scheduler.lr_lambdas[0] if isinstance(scheduler.lr_lambdas[0], Schedule) else None
    if live is not None:
        restarts = lr_restarts if lr_restarts is not None else saved.restarts if saved is not None else []
        for fn in {id(f): f for f in scheduler.lr_lambdas}.values():
            fn.restarts = [dict(r) for r in restarts]
    saved_state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)  # the functions are this run's
    if not schedule_changed and lr_restarts is None:
        scheduler.load_state_dict(saved_state)
        if live is None or saved is None or saved.record() == live.record():
            return  # the same function: the LRs as saved, bit for bit
        # another function that judge_lr found to continue the checkpoint's (a WSD run extended while
        # stable): the resume step takes this run's LR, which the checkpoint's run never computed
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
        return
    scheduler.last_epoch = saved_state["last_epoch"]
    scheduler._step_count = saved_state.get("_step_count", scheduler.last_epoch + 1)
    peak = saved.lr if saved is not None else (meta.get("schedule_fields") or {}).get("optim.lr")
    if live is not None and peak and "base_lrs" in saved_state:
        scheduler.base_lrs = list(saved_state["base_lrs"]) if live.lr == peak \
            else [base * live.lr / peak for base in saved_state["base_lrs"]]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
