"""Text -> a validated Config: read a YAML recipe, apply ``key.sub=value`` overrides, validate.

``load_config(path, overrides)`` is the one way a run gets its config (CLI, trainer, Prefect
tasks, benchmarks), so a bad config always fails the same way: a ConfigError naming the file,
the field and the reason, before any model is built. The models themselves live in
``schema.py``; ``campaign.py`` reuses the pieces below for campaign files. Like the whole config
package, this imports neither torch nor prefect.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from megatrain.config.schema import Config
from megatrain.errors import DeterministicError


class ConfigError(DeterministicError, ValueError):
    """A config that cannot be used; the message names the file, the field and the reason."""


COMMAND_LINE = "the command line"


@dataclass(frozen=True)
class Override:
    """One ``key=value`` and where it was written, so that an error about its field names that place
    (a campaign file's overrides, one stage's, the command line) and not another. A plain string
    in a list of overrides is the command line's."""

    text: str
    origin: str = COMMAND_LINE
    by_person: bool = True  # False: a value the campaign derives (paths, world size), blamed only for its own field

    def __str__(self) -> str:
        return self.text


def as_override(item: str | Override) -> Override:
    return item if isinstance(item, Override) else Override(str(item))


def load_config(path: str | Path | None = None, overrides: list[str | Override] | None = None) -> Config:
    """Read a recipe (or the defaults when ``path`` is None), apply overrides, validate. A bad
    field set by an override is blamed on the override and where it was written, not on the file."""
    raw = read_yaml(path) if path is not None else {}
    raw = merge(raw, parse_overrides(overrides))
    source = str(path) if path is not None else "<defaults>"
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc, Config, overrides)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def parse_overrides(overrides: list[str | Override] | None) -> dict[str, Any]:
    """``["optim.lr=3e-4", "model.block=serial"]`` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for override in map(as_override, overrides or []):
        item = override.text
        if "=" not in item:
            where = "" if override.origin == COMMAND_LINE else f" (in {override.origin})"
            raise ConfigError(f"override {item!r}{where}: expected key=value, e.g. optim.lr=3e-4")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_scalar(raw))
    return tree


def _parse_scalar(raw: str) -> Any:
    """YAML's reading of a value, except that '3e-4' is a float (YAML 1.1 wants '3.0e-4')."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` laid over ``base``, section by section (an override replaces one field, not its section)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def format_validation_error(source: str, error: ValidationError, model: type[BaseModel] | None = None,
                            overrides: list[str | Override] | None = None) -> str:
    """pydantic's errors as ``source: invalid config`` and one ``  field: reason`` line each. With
    the ``model`` validated, an unknown key gets the nearest known one ("did you mean"); a field
    that one of ``overrides`` set names that override and where it was written instead of the
    file, and when every line is such a field the first line names that place, not the file."""
    set_by = {o.text.split("=", 1)[0].strip(): o for o in map(as_override, overrides or []) if "=" in o.text}
    lines: list[str] = []
    blamed: list[str | None] = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        field = ".".join(loc) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden" and model is not None:
            message += _did_you_mean(model, loc)
        override = _set_by(field, message, set_by, item["type"] == "extra_forbidden")
        blamed.append(override.origin if override is not None else None)
        if override is not None:
            where = "" if override.origin == COMMAND_LINE else f" in {override.origin}"
            message += f" (set by the override {override.text!r}{where})"
        lines.append(f"  {field}: {message}")
    origins = set(blamed)
    where = origins.pop() if len(origins) == 1 and None not in origins else source
    return "\n".join([f"{where}: invalid config", *lines])


def _set_by(field: str, message: str, set_by: dict[str, Override], unknown: bool) -> Override | None:
    """The override an error of ``field`` is about: the one that set the field or a value holding
    it; for an error of a whole section (a check across its fields), the one a person wrote whose
    key the message names. A section's error is never blamed on a value the campaign derived for
    one of its other fields (a mixture's duplicate names on ``data.shard_url``). An ``unknown`` key
    (a section where none belongs) is the one an override under it brought in."""
    for key, override in set_by.items():
        if field == key or field.startswith(key + "."):
            return override
    for key, override in set_by.items():
        if override.by_person and key.startswith(field + ".") and (unknown or key in message):
            return override
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: ``X``, ``X | None``, ``list[X] | None``, ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _did_you_mean(model: type[BaseModel], loc: list[str]) -> str:
    """`` (did you mean 'lr'?)`` for an unknown key, from the fields of the section it sits in."""
    section: Any = model
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list field: the same section
            continue
        field = getattr(section, "model_fields", {}).get(part)
        candidates = _models_in(field.annotation if field is not None else None)
        if not candidates:
            return ""
        section = candidates[0]
    known = list(getattr(section, "model_fields", {}))
    close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
