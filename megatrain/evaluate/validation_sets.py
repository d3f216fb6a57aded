"""What a run validates on: each data component's held-out windows, and the mix of their losses.

A mixture's components are shard versions of their own, each with its own held-out documents
(``megatrain/data/held_out.py`` gives every version some, or a one-line reason why it cannot).
Each component is validated on the first ``train.eval_batches * train.global_batch_size`` windows
of its held-out shards (whole global batches of them when it has at least one; all of them when
it has fewer), and the run's ``val_loss`` is the mix of the components' losses under the
validation weights: ``train.eval_weights`` (a campaign sets it to its first stage's weights, so
every stage reports the same blend), else the run's own data weights. The weights are normalised
over the components that have held-out windows; a component with weight 0, or one that the
weights leave out, is evaluated and logged beside the mix, not in it.

``validation.json`` in the run dir records the choice (weights, where they came from, each
component's shard version, samples, documents and note): ``megatrain status`` and the report read
it, and ``megatrain eval`` evaluates a mixture's checkpoint on the same sets.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.config import Config
from megatrain.data.index import ShardIndex
from megatrain.data.loader import ShardCache

VALIDATION_FILE = "validation.json"


def held_out_windows(index: ShardIndex, count: int, split: str = "val", verify_checksums: bool = True) -> np.ndarray:
    """The first ``count`` windows [count, seq_len + 1] of the held-out shards (``split="val"``)
    or of the training shards (``"train"``), in shard order; fewer when there are fewer."""
    shards = index.val_shards if split == "val" else index.shards
    view = dataclasses.replace(index, shards=shards, num_samples=sum(s.num_samples for s in shards))
    cache = ShardCache(view, verify_checksums, on_bad_shard="error")
    parts, have = [], 0
    for i in range(len(shards)):
        if have >= count:
            break
        windows = cache.get(i)[: count - have]
        parts.append(windows)
        have += len(windows)
    return np.concatenate(parts) if parts else np.empty((0, index.seq_len + 1), index.np_dtype)


@dataclasses.dataclass
class ValidationSet:
    name: str  # the data component ("data" for a run of one corpus)
    url: str  # its shard version
    windows: np.ndarray  # [n, seq_len + 1]
    weight: float  # its share of the validation mix (the shares of the sets with windows sum to 1); 0: outside it
    documents: int | None  # held-out documents of its version (None: not counted when it was sharded)
    note: str  # why it has no windows, or how its split was made when the floor acted; "" otherwise


def mix_weights(cfg: Config) -> tuple[dict[str, float], str]:
    """The validation weight of every component of the run's data, and where the weights come from."""
    names = [c.name for c in cfg.data.components()]
    if cfg.train.eval_weights is None:
        return {c.name: c.weight for c in cfg.data.components()}, "this run's data weights"
    return ({name: cfg.train.eval_weights.get(name, 0.0) for name in names},
            "train.eval_weights (a campaign's default: its first stage's weights)")


def _no_windows(index: ShardIndex) -> str:
    if index.val_note:
        return index.val_note
    if index.val_documents is None:
        return (f"shard version {index.version} has no held-out samples (sharded before every version got a held-out "
                "split: a new data.shard_url shards it again with one)")
    return f"its {index.val_documents} held-out documents make no whole window"


def component_windows(index: ShardIndex, wanted: int, batch: int, verify_checksums: bool = True) -> np.ndarray:
    """A component's set: its first ``wanted`` held-out windows, cut to whole global batches
    (``batch`` windows, as a training step cuts them) when it has at least one, else all of them."""
    windows = held_out_windows(index, wanted, verify_checksums=verify_checksums)
    return windows[: len(windows) // batch * batch] if len(windows) >= batch else windows


def validation_sets(cfg: Config, components: Sequence[Any]) -> list[ValidationSet]:
    """One set per data component (``components``: objects with ``name`` and ``index``, the
    trainer's ``Component`` list), in that order, with the mix's normalised shares."""
    wanted, batch = cfg.train.eval_batches * cfg.train.global_batch_size, cfg.train.global_batch_size
    weights, _ = mix_weights(cfg)
    sets = []
    for component in components:
        index = component.index
        windows = component_windows(index, wanted, batch, cfg.data.verify_checksums)
        note = index.val_note if len(windows) else _no_windows(index)
        sets.append(ValidationSet(component.name, index.url, windows, weights.get(component.name, 0.0),
                                  index.val_documents, note))
    total = sum(s.weight for s in sets if len(s.windows))
    for s in sets:
        s.weight = s.weight / total if total > 0 and len(s.windows) else 0.0
    return sets


def describe(cfg: Config, sets: Sequence[ValidationSet]) -> list[str]:
    """The log's lines about the sets: what each component validates on (or why it cannot), and the mix."""
    lines = []
    for s in sets:
        documents = "" if s.documents is None else f", {s.documents} document{'' if s.documents == 1 else 's'}"
        if len(s.windows):
            lines.append(f"held-out set of {s.name!r}: {len(s.windows)} samples{documents}"
                         + (f" ({s.note})" if s.note else ""))
        else:
            lines.append(f"held-out set of {s.name!r}: none: {s.note}")
    if cfg.data.mixture is not None:
        _, source = mix_weights(cfg)
        mix = ", ".join(f"{s.name} {s.weight:.3g}" for s in sets if s.weight > 0) or "no component with held-out samples"
        outside = [s.name for s in sets if s.weight == 0 and len(s.windows)]
        own = ", ".join(f"{c.name} {c.weight:g}" for c in cfg.data.components())
        lines.append(f"validation mix (val_loss), from {source}: {mix}" + (f"; {', '.join(outside)} logged outside it"
                     if outside else "") + f"; the run trains on {own}")
    return lines


def write_record(run_dir: str | Path, cfg: Config, sets: Sequence[ValidationSet]) -> Path:
    """``<run_dir>/validation.json``: the mix, where its weights come from, and each component's set."""
    _, source = mix_weights(cfg)
    record = {"weights": {s.name: s.weight for s in sets if s.weight > 0}, "source": source,
              "mixture": cfg.data.mixture is not None,
              "components": {s.name: {"samples": len(s.windows), "documents": s.documents, "weight": s.weight,
                                      "note": s.note, "url": s.url} for s in sets}}
    path = Path(run_dir) / VALIDATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)  # whole or absent: status reads it while the run goes on
    return path


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A run dir's validation.json, or None (none written: a run before it, or one that never evaluated)."""
    try:
        found = json.loads((Path(run_dir) / VALIDATION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
