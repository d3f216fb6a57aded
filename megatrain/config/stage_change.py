"""What a campaign stage may change from the stage before it, whose final checkpoint it starts from.

A stage starts from the previous stage's final weights and optimizer moments (``checkpoint.init_from``,
weights and optimizer only: ``checkpoint/restore.py``). So:

- the model's shapes stay (``SHAPE_FIELDS``: every field that names or sizes a parameter or a
  persistent buffer): a change is refused at once, naming the field and both stages. Without this
  rule the ranks only found it while copying tensors, as an unverifiable checkpoint, retried;
- a context extension is allowed and said in one line (``CONTEXT_FIELDS``: the training length,
  RoPE's base and scaling, the attention mask; with ``LAYOUT_FIELDS``, how the longer sequence
  is run: context parallelism, activation checkpointing). No parameter depends on them under
  RoPE; a learned position table does (``model.seq_len`` is a shape under ``position: learned``);
- everything else (data mix, LR schedule, batch size, dropout...) is the stage's to choose, as before.

One rule for both judges: the campaign's validation (``config/campaign.py``, before any stage
trains) and the train-stage task compare two stage configs; a rank restoring the previous stage's
checkpoint compares what that checkpoint recorded (its ``state_fields`` and ``LAYOUT_FIELDS``).
Both go through ``judge`` on flat views (``stage_fields``). Imports neither torch nor prefect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatrain.config import compat
from megatrain.config.schema import Config

# Fields whose change changes a tensor's name or shape (model/gpt.py, attention.py, mlp.py, moe.py).
SHAPE_FIELDS = (
    "model.vocab_size", "model.n_layer", "model.n_head", "model.n_kv_head", "model.d_model", "model.d_ff",
    "model.ffn_multiplier", "model.ffn_multiple_of", "model.position", "model.norm", "model.mlp", "model.bias",
    "model.tie_embeddings", "model.moe.n_experts", "model.moe.n_shared_experts", "model.moe.expert_d_ff",
    "model.moe.moe_every", "model.moe.dense_layers",
)
# The context a stage trains at and how positions are encoded: no tensor depends on them under RoPE.
CONTEXT_FIELDS = ("train.seq_len", "model.seq_len", "model.rope_theta", "model.rope_scaling", "model.attention_mask")
# How the ranks run the (longer) sequence: not checkpointed state (compat._NOT_STATE), so recorded
# beside the state fields to be named in the line.
LAYOUT_FIELDS = ("parallel.cp", "parallel.cp_mode", "model.activation_checkpointing")
# The model's other fields change its math, not its tensors: a stage may change them (as before
# this rule). Listed so that a new model field must be placed (tests/megatrain/config/test_stage_change.py).
OTHER_MODEL_FIELDS = (
    "model.block", "model.attention", "model.window", "model.dropout", "model.norm_eps", "model.init_std",
    "model.kernels", "model.compile", "model.moe.top_k", "model.moe.router_score", "model.moe.norm_topk_prob",
    "model.moe.load_balance", "model.moe.aux_loss_coef", "model.moe.bias_update_rate", "model.moe.z_loss_coef",
)


class StageShapeChange(ValueError):
    """A stage that changes the model's shapes: its ranks could not load the previous stage's tensors."""


@dataclass(frozen=True)
class StageChange:
    """What a stage changes of the fields this rule watches, each [previous, this stage's]."""

    previous: str  # the stage names
    stage: str
    shapes: dict[str, list] = field(default_factory=dict)
    context: dict[str, list] = field(default_factory=dict)  # CONTEXT_FIELDS and LAYOUT_FIELDS
    seq_len: tuple[int | None, int | None] = (None, None)

    @property
    def refusal(self) -> str | None:
        """The error message of a shape change, naming each field and both stages; None: allowed."""
        if not self.shapes:
            return None
        fields = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, (old, new) in self.shapes.items())
        return (f"stage {self.stage}: changes the model's shapes from stage {self.previous}: {fields}; a stage "
                f"starts from the previous stage's final checkpoint, whose tensors have stage {self.previous}'s "
                f"shapes: keep {', '.join(self.shapes)} as stage {self.previous} has it, or start a new campaign "
                "from this model (a campaign whose first stage sets it)")

    @property
    def line(self) -> str | None:
        """The one line that says what the stage changes (None: nothing this rule watches)."""
        if not self.context:
            return None
        old, new = self.seq_len
        what = "context extension" if old and new and new > old else "changes"
        return f"stage {self.stage}: {what} from stage {self.previous}: {', '.join(self._parts())}"

    def _parts(self) -> list[str]:
        parts = []
        if self.seq_len[0] != self.seq_len[1]:
            parts.append(f"seq_len {self.seq_len[0]} -> {self.seq_len[1]}")
        order = CONTEXT_FIELDS + LAYOUT_FIELDS  # the line's order: length, RoPE, mask, then the layout
        for key, (old, new) in sorted(self.context.items(), key=lambda kv: order.index(kv[0])):
            if key in ("train.seq_len", "model.seq_len") and self.seq_len[0] != self.seq_len[1]:
                continue  # said once, as the length trained at
            if key == "model.seq_len" or key == "train.seq_len":
                parts.append(f"{key} {_show(old)} -> {_show(new)}")
            elif key == "model.rope_scaling":
                parts.append(f"rope_scaling {_scaling(old)} -> {_scaling(new)}")
            else:
                parts.append(f"{key.split('.')[-1]} {_show(old)} -> {_show(new)}")
        return parts


def layout_fields(cfg: Config) -> dict[str, object]:
    """``LAYOUT_FIELDS`` of a config, by dotted name (a checkpoint records them: manager.py)."""
    policy = cfg.model.activation_checkpointing
    return {"parallel.cp": cfg.parallel.cp, "parallel.cp_mode": cfg.parallel.cp_mode,
            "model.activation_checkpointing": policy.policy + (f" {policy.n}" if policy.policy == "every_n" else "")}


def stage_fields(cfg: Config) -> dict[str, object]:
    """The flat view ``judge`` compares: ``compat.state_fields`` plus ``layout_fields``."""
    return {**compat.state_fields(cfg), **layout_fields(cfg)}


def judge(previous: dict[str, Any], current: dict[str, Any], previous_stage: str, stage: str) -> StageChange:
    """What ``current`` (this stage's view) changes of ``previous`` (the previous stage's, as
    configured or as its checkpoint recorded it). A field the previous view does not hold: a knob
    added after it was written had its default (``compat.later_knob_defaults``); a layout field
    it did not record is not compared."""
    later = compat.later_knob_defaults()
    old = lambda k: previous[k] if k in previous else later.get(k)  # noqa: E731
    keys = sorted(set(previous) | set(current))
    changed = {k: [old(k), current.get(k)] for k in keys if old(k) != current.get(k)
               and not (_under(k, LAYOUT_FIELDS) and (k not in previous or k not in current))}
    learned = "learned" in (old("model.position"), current.get("model.position"))
    shapes = {k: v for k, v in changed.items() if _under(k, SHAPE_FIELDS) or (learned and k == "model.seq_len")}
    context = {k: v for k, v in changed.items() if k not in shapes and _under(k, CONTEXT_FIELDS + LAYOUT_FIELDS)}
    context = _fold_scaling(context, previous, current, later)
    return StageChange(previous_stage, stage, shapes, context, (_seq_len(old), _seq_len(current.get)))


def judge_configs(previous: Config, current: Config, previous_stage: str, stage: str) -> StageChange:
    return judge(stage_fields(previous), stage_fields(current), previous_stage, stage)


def _under(key: str, names: tuple[str, ...]) -> bool:
    return any(key == name or key.startswith(name + ".") for name in names)


def _seq_len(get) -> int | None:
    """The length trained at: train.seq_len, default model.seq_len (``Config.seq_len``)."""
    return get("train.seq_len") or get("model.seq_len")


def _fold_scaling(context: dict[str, list], previous: dict, current: dict, later: dict) -> dict[str, list]:
    """rope_scaling's flat keys (``model.rope_scaling.factor``...) as one entry of two dicts (None: none)."""
    if not any(_under(k, ("model.rope_scaling",)) for k in context):
        return context
    out = {k: v for k, v in context.items() if not _under(k, ("model.rope_scaling",))}
    out["model.rope_scaling"] = [_nested({**later, **previous}), _nested(current)]
    return out


def _nested(view: dict) -> dict | None:
    prefix = "model.rope_scaling."
    found = {k[len(prefix):]: v for k, v in view.items() if k.startswith(prefix) and v is not None}
    if not found:
        return None
    return {"rope_type": "llama3", **found}  # compat._as_before drops llama3's tag


def _scaling(value: dict | None) -> str:
    if not value:
        return "none"
    extra = f", original {value['original_max_position']}" if "original_max_position" in value else ""
    return f"{value.get('rope_type', 'llama3')} (factor {_show(value.get('factor'))}{extra})"


def _show(value: object) -> str:
    """10000.0 -> 10000, 0.5 -> 0.5, None -> none."""
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
