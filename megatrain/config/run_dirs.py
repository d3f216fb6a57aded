"""A run's folder on disk: what a folder given to a command is, and where the paths a run recorded
lie now.

A run dir owns its files: checkpoints (``<run_dir>/checkpoints``), staging, metrics and
TensorBoard live under it unless a field says otherwise (``schema.Config``). What a run records
about itself lies in the run dir too: ``run.json`` (the resolved config, written by rank 0 at the
start of every attempt: ``megatrain/interop/checkpoint.py``) and, for a campaign's stage,
``config.yaml`` (the stage's config, frozen by the flow). Their paths are absolute, or, in records
written before that rule, relative to the working directory of the run.

A run dir may be moved or copied after it trained, and commands run from any folder. So a path a
run recorded is read against where the run dir is *now* (``relocate``): a path inside the run
dir (its checkpoints, staging, logs) is taken from the run dir's present location, a copy's from
the copy; a path beside it (a campaign's ``durable/<stage>``, one level up) is taken as recorded
while it exists, else from where it would be now that the campaign dir moved; anything else
(another disk, an ``s3://`` URL) as recorded.

``megatrain eval|generate|export|status`` accept a run dir, a stage dir of a campaign, or a
campaign dir, which stands for its final stage (``find_run_dir``). No torch, no storage: local
folders only (a URL is never a run dir).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.config.campaign import stage_dirs
from megatrain.config.load import read_yaml
from megatrain.errors import InputError

RUN_RECORD = "run.json"  # rank 0's record of a run: {"config", "data_index", "tokenizer"}
STAGE_CONFIG = "config.yaml"  # a campaign stage's config, written by the flow before its ranks start
# What eval, generate and export take as --checkpoint (megatrain/interop/checkpoint.py resolves it).
CHECKPOINT_HELP = ("a run dir, a campaign's stage dir, a campaign dir (its final stage), a checkpoint dir or URL, "
                   "or one step-* dir; from any working directory")
HF_PREFIX = "hf:"  # checkpoint.init_from of a transformers folder (megatrain.interop.hf.HF_PREFIX)

# The locations a run owns, read against where its run dir is now (``RunDir.located``).
OWN_LOCATIONS = (("checkpoint", "durable_url"), ("checkpoint", "staging_dir"), ("train", "tensorboard_dir"))


def is_url(path: str) -> bool:
    """An fsspec URL (``s3://``, ``memory://``, ``file://``): never moved with a run dir."""
    return "://" in path


def absolute(path: str, cwd: str | None = None) -> str:
    """A local path made absolute against ``cwd`` (default the working directory); a URL as given."""
    return path if is_url(path) or os.path.isabs(path) else os.path.normpath(os.path.join(cwd or os.getcwd(), path))


def absolute_locations(config: dict[str, Any], cwd: str | None = None) -> dict[str, Any]:
    """``config`` (a dumped run config) with every local path it holds made absolute against
    ``cwd``, in place: what a run records must not depend on the folder it was started from."""
    for section, key in (*OWN_LOCATIONS, ("train", "run_dir"), ("data", "shard_url")):
        if config.get(section, {}).get(key):
            config[section][key] = absolute(config[section][key], cwd)
    checkpoint, data = config.get("checkpoint", {}), config.get("data", {})
    init = checkpoint.get("init_from")
    if init:  # a durable URL, or hf:<a transformers folder>
        prefix = HF_PREFIX if init.startswith(HF_PREFIX) else ""
        checkpoint["init_from"] = prefix + absolute(init[len(prefix):], cwd)
    if data.get("tokenizer") and data["tokenizer"] != "bpe":  # bpe: trained on the corpus, not a file
        data["tokenizer"] = absolute(data["tokenizer"], cwd)
    for sources in [data.get("sources") or [], *((c.get("sources") or []) for c in data.get("mixture") or [])]:
        sources[:] = [s if s == "stdlib" else absolute(s, cwd) for s in sources]  # stdlib: a named corpus
    return config


def relocate(recorded: str, recorded_run_dir: str, run_dir: Path) -> str:
    """Where ``recorded``, a local path a run wrote down while its run dir was ``recorded_run_dir``,
    lies now that the run dir is ``run_dir``: the first of its candidates that exists (see the
    module docstring for their order), else the first (so an error names where it should be).
    Both recorded paths are absolute, or (older records) both relative to one working directory."""
    if is_url(recorded) or os.path.isabs(recorded) != os.path.isabs(recorded_run_dir):
        return recorded
    rel = os.path.relpath(os.path.normpath(recorded), os.path.normpath(recorded_run_dir))
    here, ups = os.path.normpath(run_dir / rel), rel.split(os.sep).count(os.pardir)
    if ups == 0:
        candidates = [here, recorded]  # inside: the run dir's own
    elif ups == 1:
        candidates = [recorded, here]  # beside it, as a campaign's durable/<stage> is to its stage dir
    else:
        candidates = [recorded]
    return next((c for c in candidates if os.path.exists(c)), candidates[0])


@dataclass
class RunDir:
    """A run dir as found on disk: where it is now and what it recorded."""

    path: Path  # absolute, where it lies now
    config: dict[str, Any]  # the run's config as recorded: run.json's, else config.yaml's
    record: dict[str, Any] | None  # run.json, when rank 0 wrote one
    campaign: Path | None = None  # the campaign dir, when this was found as a campaign's final stage

    @property
    def recorded_path(self) -> str:
        """Where the run dir was when it recorded its paths."""
        return str(self.config.get("train", {}).get("run_dir") or self.path)

    def where(self, recorded: str) -> str:
        """A path this run recorded, where it lies now (``relocate``)."""
        return relocate(recorded, self.recorded_path, self.path)

    def located(self) -> dict[str, Any]:
        """The run's config with its own locations (run dir, checkpoints, staging, TensorBoard)
        where they lie now: a config that works from any working directory."""
        config = copy.deepcopy(self.config)
        for section, key in OWN_LOCATIONS:
            value = config.get(section, {}).get(key)
            if value:
                config[section][key] = self.where(str(value))
        config.setdefault("train", {})["run_dir"] = str(self.path)
        return config

    def data_index(self) -> str | None:
        """The shard version the run trained on, from run.json (a path beside the run, or a URL)."""
        recorded = (self.record or {}).get("data_index")
        return self.where(recorded) if recorded else None


def read_record(path: Path) -> dict[str, Any] | None:
    """``path/run.json``, or None when there is none. A damaged one is an InputError naming it."""
    file = path / RUN_RECORD
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except (ValueError, OSError) as exc:
        raise InputError(f"{file}: not a readable run record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise InputError(f"{file}: not a megatrain run record (no config)")
    return record


def read_run_dir(path: str | Path) -> RunDir | None:
    """The run dir at ``path`` (a folder holding run.json or a stage's config.yaml), else None."""
    path = Path(path).resolve()
    if not path.is_dir():
        return None
    record = read_record(path)
    if record is not None:
        return RunDir(path, record["config"], record)
    if (path / STAGE_CONFIG).is_file():
        return RunDir(path, read_yaml(path / STAGE_CONFIG), None)
    return None


def is_stage_dir(path: str | Path) -> bool:
    """A run dir that is one of the stages of the campaign dir holding it."""
    path = Path(path).resolve()
    return (path / STAGE_CONFIG).is_file() and path in stage_dirs(path.parent)


def find_run_dir(target: str | Path) -> RunDir | None:
    """The run dir that ``target`` names: itself (a run dir or a campaign's stage dir), or a
    campaign dir's final stage. None when ``target`` is none of these (a checkpoint dir, a URL)."""
    if is_url(str(target)):
        return None
    run = read_run_dir(target)
    if run is not None or not Path(target).is_dir():
        return run
    stages = stage_dirs(Path(target).resolve())
    if not stages:
        return None
    final = read_run_dir(stages[-1])
    assert final is not None  # stage_dirs lists only folders with a config.yaml
    final.campaign = Path(target).resolve()
    return final
