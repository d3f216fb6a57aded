"""The parts of an imported recipe that belong to the user, not to the model: ``megatrain import``
takes its model from config.json, but its data, optimizer and schedule from a base recipe written
for some other model (``configs/llama-tiny-cpu.yaml`` trains a 2-layer toy with LAMB at lr 0.02
on the standard library). Silently kept, those make a recipe for a toy.

So the import:

- turns caps off (``CAPS``: ``data.max_source_bytes``, a demo's way to train in seconds, would
  read a few percent of a real corpus) unless the command asks for one (``--max-source-bytes``);
- writes every value a team must decide for its model (``DECIDE``: the corpus, the optimizer and
  its learning rate, the schedule, the length of the run) explicitly into the recipe, with a
  comment above it that says where it came from (the base recipe, or megatrain's default) and
  what it decides, and prints the same list.

``commented_yaml`` puts the comments in: PyYAML writes no comments, and its block style (two
spaces a level, lists at their key's indent) makes ``  key:`` at the start of a line the second
level, so a comment line goes just above it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# (section, key): what the value decides. Sections and keys as the recipe spells them.
DECIDE: dict[tuple[str, str], str] = {
    ("data", "sources"): "the corpus this model continues on",
    ("data", "mixture"): "the corpus this model continues on, and each part's share",
    ("optim", "name"): "the optimizer (lamb or adamw)",
    ("optim", "lr"): "the peak learning rate, for these trained weights",
    ("optim", "min_lr"): "the learning rate the schedule ends at",
    ("optim", "warmup_steps"): "the warm-up (a fresh optimizer state on trained weights)",
    ("optim", "schedule"): "the schedule (cosine, wsd or constant)",
    ("optim", "decay_steps"): "the schedule's decay length",
    ("optim", "weight_decay"): "the weight decay",
    ("train", "steps"): "the length of the run, in optimizer steps",
    ("train", "global_batch_size"): "the samples per optimizer step",
}
CAPS = (("data", "max_source_bytes"),)  # limits a demo sets that make a run read less than its corpus


@dataclass(frozen=True)
class Choice:
    """A value of the written recipe the user must decide, and where it came from."""

    section: str
    key: str
    value: Any
    source: str  # the base recipe's file, or "megatrain's default"
    what: str

    @property
    def comment(self) -> str:
        return f"decide: {self.what} (from {self.source}, not chosen for this model)"

    @property
    def line(self) -> str:
        return f"decide {self.section}.{self.key} = {_short(self.value)} (from {self.source}): {self.what}"


def _short(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], dict):  # a mixture
        return "[" + ", ".join(f"{c.get('name')} {c.get('weight')}" for c in value) + "]"
    return repr(value)


def _default(section: str, key: str) -> Any:
    from megatrain.config import DataConfig, OptimConfig, TrainConfig

    return getattr({"data": DataConfig, "optim": OptimConfig, "train": TrainConfig}[section](), key)


def drop_caps(recipe: dict[str, Any], base_name: str, asked: dict[str, int | None]) -> list[str]:
    """Remove the base recipe's caps (or set the asked ones): the lines that say so."""
    lines = []
    for section, key in CAPS:
        part = recipe.setdefault(section, {})
        was = part.pop(key, None)
        if asked.get(key) is not None:
            part[key] = asked[key]
            lines.append(f"{section}.{key} {asked[key]} (--{key.replace('_', '-')})")
        elif was is not None:
            lines.append(f"{section}.{key} {was} of {base_name} dropped: every source is read whole "
                         f"(--{key.replace('_', '-')} N caps it)")
    return lines


def decisions(recipe: dict[str, Any], base: dict[str, Any], base_name: str) -> list[Choice]:
    """Write each value the user must decide explicitly into ``recipe``, and name where it came from."""
    choices = []
    for (section, key), what in DECIDE.items():
        given = (base.get(section) or {})
        if section == "data" and key == "sources" and given.get("mixture"):
            continue  # a mixture names the corpus instead
        if section == "data" and key == "mixture" and not given.get("mixture"):
            continue
        if key in given:
            value, source = given[key], base_name
        else:
            value, source = _default(section, key), "megatrain's default"
            if value is None:  # e.g. decay_steps: unset, derived from train.steps
                continue
            if isinstance(value, tuple):
                value = list(value)
        recipe.setdefault(section, {})[key] = value
        choices.append(Choice(section, key, value, source, what))
    return choices


def commented_yaml(recipe: dict[str, Any], choices: list[Choice], header: list[str]) -> str:
    """The recipe as YAML, ``header`` as comment lines on top and each choice's comment above its key."""
    import yaml

    notes = {(c.section, c.key): c.comment for c in choices}
    out, section = [f"# {line}" for line in header], None
    for line in yaml.safe_dump(recipe, sort_keys=False).splitlines():
        top = re.match(r"^([A-Za-z_]\w*):", line)
        second = re.match(r"^  ([A-Za-z_]\w*):", line)
        if top:
            section = top.group(1)
        elif second and (section, second.group(1)) in notes:
            out.append(f"  # {notes[(section, second.group(1))]}")
        out.append(line)
    return "\n".join(out) + "\n"
