"""Which config changes a checkpoint survives: the policy, by field, kept beside the checkpoints.

Three views of one ``Config``:

- ``fingerprint(cfg)``: a short hash of everything that changes the computation (not logging or
  paths): the identity of a finished result (campaign stage caches).
- ``state_fields(cfg)``: what a checkpoint holds (model shapes and math, optimizer kind,
  precision, data and seeds); a checkpoint written under other values cannot be continued.
- ``schedule_fields(cfg)``: how that state moves on (global batch, LR schedule, optimizer
  hyper-parameters); changing one on resume needs ``checkpoint.allow_schedule_change``, except
  the fields of the LR schedule (``LR_SCHEDULE_FIELDS``): they are recorded, but restore judges
  the schedule as a function of the step (``megatrain/optim/schedule.py``), since other values can
  give the same LRs (a WSD decay given as a share or as steps) and the same values other LRs (a WSD
  run extended after its decay began).

Restore (``checkpoint/restore.py``) compares the last two field by field, never the hash. Like
``megatrain.config`` this imports neither torch nor prefect: the flow computes stage fingerprints.
"""

from __future__ import annotations

import hashlib
import json

from megatrain.config.schema import Config

# Fields added after checkpoints were first written, by dotted section: the fingerprint counts
# each only when it is set away from its default, so older recipes keep their fingerprints (and
# resume their checkpoints). A branch adding fields to a section lists them here too.
_LATER_KNOBS: dict[str, tuple[str, ...]] = {
    "model": ("n_kv_head", "ffn_multiplier", "ffn_multiple_of", "position", "rope_theta", "rope_scaling", "norm", "mlp", "moe",
              "attention_mask"),
    "model.kernels": ("rmsnorm", "swiglu", "rope", "experts", "moe_permute", "moe_router"),
    "train.fp8": ("casts", "experts"),  # casts: an implementation choice, like model.kernels: the same e4m3 values
    "data": ("mixture", "on_exhausted", "on_bad_source", "unit_bytes", "worker_cores", "max_replaced_fraction", "cursors"),
    "optim": ("decay_fraction",),
    "parallel": ("ep", "cp", "cp_mode"),  # expert and context parallelism: 1 for every run before them
    "parallel.overlap": ("ep_shared_expert",),
}

# Held-out evaluation and experiment tracking: they change what is measured, never the training math.
_TRACKING_KNOBS = ("eval_interval", "eval_batches", "eval_weights", "tensorboard", "tensorboard_dir", "wandb_project",
                   "mlflow_tracking_uri")

# Fields that change neither the checkpointed state nor how it evolves: the length of the run,
# the split of the global batch into micro-batches, kernels, compile, activation checkpointing,
# the parallel layout, where files go, and the checkpoint and reliability policies.
_NOT_STATE = {
    "name": True, "parallel": True, "checkpoint": True, "reliability": True,
    "model": {"kernels", "activation_checkpointing", "compile"},
    "train": {**dict.fromkeys(["steps", "micro_batch_size", "device", "log_interval", "run_dir", *_TRACKING_KNOBS], True),
              "fp8": {"casts"}},  # who casts to FP8 changes no state: checkpoints resume under any
    "data": {"shard_url", "num_workers", "worker_cores", "prefetch_batches", "on_bad_shard", "verify_checksums", "engine", "dask_address"},
}

SCHEDULE_FIELDS = (
    "train.global_batch_size", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule", "optim.decay_steps",
    "optim.betas", "optim.eps", "optim.weight_decay", "optim.max_trust_ratio", "optim.grad_clip",
    "optim.decay_fraction",
)
# What defines the LR of each step (with train.steps): compared as the function they make, not by value.
LR_SCHEDULE_FIELDS = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule", "optim.decay_steps",
                      "optim.decay_fraction")


def fingerprint(cfg: Config) -> str:
    """A short hash of everything that changes the computation (not logging or paths): the
    identity of a finished result (campaign stage caches). Whether a *checkpoint* can be
    continued is decided by ``state_fields()`` and ``schedule_fields()``, not by this hash."""
    # how the ranks meet (parallel.init) never changes the math, nor do the run's logs and policies
    keep = cfg.model_dump(mode="json", exclude={"train": {"log_interval", "run_dir"}, "parallel": {"init"},
                                                "checkpoint": True, "reliability": True,
                                                "data": {"engine", "dask_address"}})  # every engine: the same shards
    # Knobs added after the first checkpoints were written count only when set away from their
    # defaults, so a GPT recipe keeps its fingerprint (and resumes its checkpoints).
    for dotted, knobs in _LATER_KNOBS.items():
        section, dumped = cfg, keep
        for part in dotted.split("."):
            section, dumped = getattr(section, part), dumped.get(part, {})
        defaults = type(section)()
        for knob in knobs:
            if knob in dumped and getattr(section, knob) == getattr(defaults, knob):
                dumped.pop(knob)
    _as_before(keep["model"])
    for knob in _TRACKING_KNOBS:  # what is measured, not how the model trains
        keep["train"].pop(knob)
    if cfg.data.val_fraction == 0.0:  # counts only when a validation split is asked for
        keep["data"].pop("val_fraction")
    if cfg.train.precision == "bf16":  # added with FP8; train.fp8 is unused then
        keep["train"].pop("precision")
        keep["train"].pop("fp8")
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _as_before(model: dict) -> None:
    """A model section dumped as it was before the tagged RoPE scaling and the checkpointing
    policies: an untagged Llama 3 scaling, a bool for none / full; so recipes keep their
    fingerprints and checkpoints their state fields."""
    scaling = model.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type") == "llama3":
        scaling.pop("rope_type")
    policy = model.get("activation_checkpointing")
    if isinstance(policy, dict) and policy.get("policy") in ("none", "full") and policy.get("n") == 1:
        model["activation_checkpointing"] = policy["policy"] == "full"


def state_fields(cfg: Config) -> dict[str, object]:
    """The fields that define what a checkpoint holds, by dotted name: the model's shapes and
    math, the optimizer kind, the precision, the data (and so its sample order) and the seeds.
    A checkpoint written under other values of any of these cannot be continued."""
    dump = cfg.model_dump(mode="json", exclude=_NOT_STATE)
    _as_before(dump["model"])
    return {k: v for k, v in _flatten(dump).items() if k not in SCHEDULE_FIELDS}


def schedule_fields(cfg: Config) -> dict[str, object]:
    """How the state moves on: global batch, LR schedule (with its effective decay length) and
    optimizer hyper-parameters. Changing one on resume needs ``checkpoint.allow_schedule_change``."""
    flat = _flatten(cfg.model_dump(mode="json"))
    out = {k: flat[k] for k in SCHEDULE_FIELDS}
    # decay_steps defaults to train.steps: extending a cosine run changes its schedule; a WSD run's
    # definition (lr, warm-up, the decay's length or share) does not move with train.steps
    out["optim.decay_steps"] = (None if cfg.optim.schedule == "constant" else cfg.optim.decay_steps
                                if cfg.optim.schedule == "wsd" else cfg.optim.decay_steps or cfg.train.steps)
    return out


def later_knob_defaults() -> dict[str, object]:
    """Each knob added after checkpoints were first written, by dotted name, with its default (as
    JSON): a checkpoint that does not record one was written under that default. Restore fills
    them in before comparing fields, so adding a knob never strands an older checkpoint."""
    defaults: dict[str, object] = {}
    for dotted, knobs in _LATER_KNOBS.items():
        section: object = Config()
        for part in dotted.split("."):
            section = getattr(section, part)
        dumped = type(section)().model_dump(mode="json")  # type: ignore[operator]
        for knob in knobs:
            value = dumped[knob]
            flat = _flatten(value, f"{dotted}.{knob}.") if isinstance(value, dict) else {f"{dotted}.{knob}": value}
            defaults.update(flat)
    return defaults


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
