"""A pretraining campaign: one recipe trained through an ordered list of stages.

Each stage is the base recipe plus the campaign's overrides plus the stage's own (sequence length,
batch size, LR schedule, data mix...). A stage starts from the previous stage's final checkpoint
(weights and optimizer state, fresh step count and schedule) and keeps its own run directory and
durable checkpoint URL, so a rerun can tell finished stages from the interrupted one.

Like the rest of ``megatrain.config`` this imports neither torch nor prefect:
the flow validates a campaign before anything heavy starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from megatrain.config import compat, stage_change
from megatrain.config.load import (
    ConfigError, Override, format_validation_error, load_config, merge, parse_overrides, read_yaml,
)
from megatrain.config.schema import Config
from megatrain.config.schema import ReliabilityConfig  # noqa: F401  (re-exported for flows)
from megatrain.config.section import _Section

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT / "runs" / "campaigns"  # where campaign ids live (a campaign dir per id)


class StageConfigError(Exception):
    """A stage that does not resolve to a valid run config (``load_campaign`` names the file). Not
    a ValueError, so that pydantic passes it through whole instead of wrapping it as an error of
    the campaign's top level, whose override (none, or ``id=``) it would then be blamed on."""


class StageConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="used in paths and task names; starts with a letter or digit (never . or ..)")
    steps: int = Field(gt=0, description="optimizer steps in this stage")
    overrides: list[str] = Field(default_factory=list, description="dotted overrides for this stage only")
    data_cursor: Literal["continue", "restart"] = Field(
        "continue", description="continue: each data component goes on in its own sample order where the previous "
        "stage left it (new samples, at this stage's weights; an epoch counts when a component wraps); restart: "
        "every component starts again at its sample 0, replaying what earlier stages read")


class CampaignConfig(_Section):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                    description="names the campaign's directories and cache keys; starts with a letter or digit")
    recipe: str = Field(description="path of the base recipe (relative paths: from the repository root)")
    overrides: list[str] = Field(default_factory=list, description="dotted overrides for every stage")
    nproc_per_node: int = Field(1, gt=0, description="training ranks per node; 'auto': one per CUDA device this "
                                "machine sees (CUDA_VISIBLE_DEVICES honoured), refused at once on a machine without one")
    nnodes: int = Field(1, gt=0, description="nodes of nproc_per_node ranks; launcher local: that many torchrun "
                        "agents on this machine meeting through a c10d rendezvous (megatrain.launch.nodes), each node "
                        "self-checked before every attempt (reliability.on_node_loss: wait | shrink)")
    launcher: Literal["local", "kubernetes", "hosts"] = Field(
        "local", description="local: this machine's processes (nnodes torchrun agents on loopback); kubernetes: an "
        "indexed Job of nnodes pods; hosts: nnodes hosts of a one-machine cluster (megatrain/launch/hosts.py, root "
        "only), each node's ranks started inside its host, found lost by their heartbeats in the cluster's Redis")
    cluster: str | None = Field(
        None, pattern=r"^mtc[0-9a-f]{6}$", description="launcher hosts: the name of a running cluster (megatrain "
        "cluster up --hosts N, with its services) the stages run on, left up afterwards; None: the flow brings up "
        "one of nnodes hosts for the campaign and takes it down when it ends, however it ends")
    root_dir: str = Field("runs/campaigns", description="local directory for run dirs, staging and reports")
    durable_url: str | None = Field(None, description="fsspec URL for committed checkpoints; default <root_dir>/<id>/durable")
    shard_url: str | None = Field(None, description="where the shards go; default the recipe's data.shard_url")
    self_check: bool = True
    samples: int = Field(3, ge=0, le=3,
                         description="texts sampled on CPU from each stage's final checkpoint for the report, one "
                         "per prompt of megatrain.evaluate.generate.DEFAULT_PROMPTS (fixed seed); 0 = none")
    export: bool = Field(True, description="end with the final stage's model as a Hugging Face folder in "
                         "<campaign dir>/model, loaded back by transformers and checked against megatrain's (the "
                         "report says why when no transformers class computes the model exactly)")
    stage_timeout_s: float = Field(6 * 3600, gt=0, description="a stage attempt is killed after this long")
    stages: list[StageConfig] = Field(min_length=1)

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _auto_is_the_visible_gpus(cls, value: object) -> object:
        return visible_gpus() if value == "auto" else value

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[StageConfig]) -> list[StageConfig]:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        return stages

    @model_validator(mode="after")
    def _cluster_is_for_hosts(self) -> CampaignConfig:
        if self.cluster is not None and self.launcher != "hosts":
            raise ValueError(f"cluster {self.cluster}: only launcher hosts runs on a cluster of hosts "
                             f"(launcher is {self.launcher})")
        return self

    @model_validator(mode="after")
    def _every_stage_is_a_valid_run(self) -> CampaignConfig:
        configs = []
        for index in range(len(self.stages)):
            try:
                configs.append(stage_config(self, index))
            except ConfigError as exc:  # not a ValueError to pydantic: it would file it under "(top level)"
                raise StageConfigError(str(exc)) from None
        for index in range(1, len(self.stages)):  # each starts from the one before: the same shapes (stage_change.py)
            refusal = self.stage_change(index, configs[index - 1], configs[index]).refusal
            if refusal:
                raise StageConfigError(refusal)
        return self

    def stage_change(self, index: int, previous: Config | None = None, current: Config | None = None):
        """What stage ``index`` (> 0) changes of the stage before it (``stage_change.judge``)."""
        previous = previous or stage_config(self, index - 1)
        current = current or stage_config(self, index)
        return stage_change.judge_configs(previous, current, self.stages[index - 1].name, self.stages[index].name)

    @property
    def campaign_dir(self) -> Path:
        return _resolve(self.root_dir) / self.id

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def stage_dir(self, index: int) -> Path:
        return self.campaign_dir / self.stages[index].name

    def stage_durable_url(self, index: int) -> str:
        base = self.durable_url or str(self.campaign_dir / "durable")
        return f"{base.rstrip('/')}/{self.stages[index].name}"

    def fingerprint(self) -> str:
        """What the campaign computes: each stage's config fingerprint, in order."""
        # a stage that restarts its data trains on other samples than one that continues it
        parts = [compat.fingerprint(stage_config(self, i)) + ("/restart" if stage.data_cursor == "restart" else "")
                 for i, stage in enumerate(self.stages)]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def visible_gpus() -> int:
    """The CUDA devices this process sees (``nproc_per_node: auto``); ValueError without one. torch is
    imported only here, so a campaign with a number never loads it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    count = 0
    if not hidden:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        raise ValueError("auto means one rank per GPU, and this machine has no CUDA device"
                         + (" visible (CUDA_VISIBLE_DEVICES hides them)" if hidden else "")
                         + ": this campaign needs a GPU (on CPU run configs/campaign-local.yaml, or set nproc_per_node)")
    return count


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


# Paths the campaign owns per stage: an override of one would be silently replaced, so it is refused
# with the campaign field to use instead. checkpoint.staging_dir is honoured (see _staging_dir).
_CAMPAIGN_PATHS = {
    "train.run_dir": "set the campaign's root_dir (each stage gets <root_dir>/<id>/<stage>)",
    "checkpoint.durable_url": "set the campaign's durable_url (each stage gets a subfolder)",
    "checkpoint.init_from": "a stage starts from the previous stage's checkpoint; start a new campaign instead",
    "data.cursors": "a stage continues each data component where the previous stage left it; set the stage's "
                    "data_cursor: restart to start them over",
}


# A run's ways to start over that a campaign takes away (it sets each stage's checkpoint.durable_url;
# checkpoint.resume=false would start the stage from nothing, not from the previous stage): in the
# campaign's own terms.
_START_OVER = re.compile(r"(?:use another checkpoint\.durable_url, or |repair or remove them, or )(?:set )?"
                         r"checkpoint\.resume=false(?: to start over)?")


def in_campaign_terms(message: str, stage: str) -> str:
    """A rank's refusal with the remedies a campaign accepts in place of those it refuses."""
    return _START_OVER.sub(f"change stage {stage!r} back to what the checkpoint has, or start a new campaign "
                           "(another id: every stage trains anew)", message)


def _overridden(overrides: list[str | Override], dotted: str) -> Override | None:
    """The last of ``overrides`` that sets the dotted key or a section holding it, or None."""
    found = None
    for override in overrides:
        key = str(override).split("=", 1)[0].strip()
        if dotted == key or dotted.startswith(key + "."):
            node: object = parse_overrides([override])
            for part in dotted.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            found = override if node is not None else found
    return found


def _value(override: Override | None, dotted: str) -> object | None:
    node: object = parse_overrides([override]) if override is not None else {}
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _staging_dir(campaign: CampaignConfig, index: int, overrides: list[str | Override]) -> Path:
    """The stage's staging dir: <the user's checkpoint.staging_dir>/<id>/<stage> when the campaign
    or the stage overrides it (a fast local disk, say), else <stage dir>/staging."""
    chosen = _value(_overridden(overrides, "checkpoint.staging_dir"), "checkpoint.staging_dir")
    if chosen is None:
        return campaign.stage_dir(index) / "staging"
    return _resolve(str(chosen)) / campaign.id / campaign.stages[index].name


CAMPAIGN_OVERRIDES = "the campaign's overrides"


def stage_overrides(campaign: CampaignConfig, index: int) -> list[Override]:
    """What a person wrote for one stage, each with where: the campaign's overrides, then the stage's."""
    stage = campaign.stages[index]
    return [*(Override(o, CAMPAIGN_OVERRIDES) for o in campaign.overrides),
            *(Override(o, f"the overrides of stage {stage.name!r}") for o in stage.overrides)]


def stage_config(campaign: CampaignConfig, index: int) -> Config:
    """The full run config of one stage: recipe + campaign overrides + stage overrides + paths."""
    stage = campaign.stages[index]
    stage_dir = campaign.stage_dir(index)
    user = stage_overrides(campaign, index)
    for dotted, instead in _CAMPAIGN_PATHS.items():
        override = _overridden(user, dotted)
        if override is not None:
            raise ConfigError(f"stage {stage.name!r}: {dotted} is set by the campaign for each stage, so an override "
                              f"of it would be ignored; {instead} (set by the override {override.text!r} in "
                              f"{override.origin})")

    def derived(text: str, origin: str) -> Override:
        return Override(text, f"the campaign's {origin}", by_person=False)

    derived_overrides = [
        derived(f"train.steps={stage.steps}", f"steps of stage {stage.name!r}"),
        derived(f"train.run_dir={stage_dir}", "root_dir"),
        derived(f"checkpoint.staging_dir={_staging_dir(campaign, index, user)}", "staging folder"),
        derived(f"checkpoint.durable_url={campaign.stage_durable_url(index)}", "durable_url"),
        derived(f"parallel.world_size={campaign.world_size}", "nproc_per_node x nnodes"),
    ]
    if campaign.launcher == "kubernetes":  # no TCP store on a cluster network: it has no authentication
        store = _value(_overridden(user, "parallel.init.store"), "parallel.init.store")
        if store not in (None, "redis", "auto"):
            raise ConfigError(f"stage {stage.name!r}: parallel.init.store={store}: on launcher kubernetes the ranks "
                              "meet in the campaign's Redis, which requires a password (torch's TCP store, open to "
                              "every pod, has none); leave parallel.init.store out")
        derived_overrides.append(derived("parallel.init.store=redis", "launcher (kubernetes)"))
    if campaign.shard_url:
        derived_overrides.append(derived(f"data.shard_url={campaign.shard_url}", "shard_url"))
    if index > 0:
        derived_overrides.append(derived(f"checkpoint.init_from={campaign.stage_durable_url(index - 1)}",
                                         "previous stage"))
    try:
        cfg = load_config(_resolve(campaign.recipe), [*user, *derived_overrides])
    except ConfigError as exc:  # name the stage; the fields are those of the resolved run config
        where, _, fields = str(exc).partition("\n")
        if where == f"{_resolve(campaign.recipe)}: invalid config":  # a field of the recipe file itself
            where = f"{campaign.recipe}: invalid config"
        elif fields:  # every line names its override and where it was written
            where = "invalid config"
        raise ConfigError(f"stage {stage.name!r}: {where}" + (f"\n{fields}" if fields else "")) from None
    if campaign.launcher == "kubernetes" and not (cfg.parallel.init.redis_url or cfg.reliability.redis_url):
        raise ConfigError(f"stage {stage.name!r}: launcher kubernetes needs reliability.redis_url: the ranks meet in "
                          "the campaign's Redis (password in MEGATRAIN_REDIS_PASSWORD), not in a TCP store")
    if "://" not in cfg.data.shard_url:  # a relative path is the repository's, whatever the cwd
        cfg.data.shard_url = str(_resolve(cfg.data.shard_url))
    if cfg.train.eval_weights is None and cfg.data.mixture is not None:
        cfg.train.eval_weights = first_stage_weights(campaign, cfg, index)
    return cfg


def first_stage_weights(campaign: CampaignConfig, cfg: Config, index: int) -> dict[str, float] | None:
    """A stage's default validation mix (``train.eval_weights``): the first stage's (its
    ``train.eval_weights`` if set, else its data weights), of the components this stage has, so
    every stage's val_loss is the same blend; None (the stage's own weights) when the first stage
    shares no component with it."""
    first = cfg if index == 0 else stage_config(campaign, 0)
    mix = first.train.eval_weights or {c.name: c.weight for c in first.data.components()}
    names = {c.name for c in cfg.data.components()}
    shared = {name: weight for name, weight in mix.items() if name in names}
    return shared if any(weight > 0 for weight in shared.values()) else None


def load_campaign(path: str | Path, overrides: list[str] | None = None) -> CampaignConfig:
    """Read and validate a campaign file; every stage is validated as a full run config. An error
    names the file, and for a stage its name, the field and the override that set it with where
    it was written: the campaign's overrides, the stage's, or the command line."""
    raw = merge(read_yaml(path), parse_overrides(overrides))
    try:
        return CampaignConfig.model_validate(raw)
    except StageConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(format_validation_error(str(path), exc, CampaignConfig, overrides)) from None


# A campaign on disk: runs/campaigns/<id>/ holds one folder per stage, each with its run config.

def find_campaign_dir(target: str | Path, root: str | Path | None = None) -> Path:
    """A campaign dir given itself, a path inside it (a stage or durable dir), or an id under
    ``root`` (default ``runs/campaigns``). Raises FileNotFoundError naming what was looked for."""
    path = Path(target)
    for candidate in (path, *path.resolve().parents[:3]) if path.exists() else ():
        if candidate.is_dir() and stage_dirs(candidate):
            return candidate
    by_id = Path(root or DEFAULT_ROOT) / str(target)
    if by_id.is_dir() and stage_dirs(by_id):
        return by_id
    raise FileNotFoundError(f"{target}: not a campaign dir (no stage folders with config.yaml), "
                            f"and no campaign of that id under {root or DEFAULT_ROOT}")


def _in_campaign(config: dict, key: str) -> str:
    """A stage config's ``checkpoint.<key>`` relative to the campaign dir it was written in (the
    parent of its run dir): a campaign moved after one stage was written and before the next
    still chains (their configs then hold the old and the new absolute paths)."""
    value = str(config.get("checkpoint", {}).get(key))
    run_dir = str(config.get("train", {}).get("run_dir") or "")
    if "://" in value or not os.path.isabs(value) or not os.path.isabs(run_dir):
        return value
    return os.path.relpath(os.path.normpath(value), os.path.dirname(os.path.normpath(run_dir)))


def stage_dirs(campaign_dir: Path) -> list[Path]:
    """The stage folders, in training order (by their init_from chain)."""
    configs = {d: read_yaml(d / "config.yaml") for d in sorted(campaign_dir.iterdir())
               if d.is_dir() and (d / "config.yaml").is_file()}
    # as written, else relative to the campaign dir each was written in (a campaign moved between stages)
    by_durable = {str(c.get("checkpoint", {}).get("durable_url")): d for d, c in configs.items()}
    by_relative = {_in_campaign(c, "durable_url"): d for d, c in configs.items()}
    previous = {d: by_durable.get(str(c.get("checkpoint", {}).get("init_from")))
                or by_relative.get(_in_campaign(c, "init_from")) for d, c in configs.items()}
    ordered, current = [], [d for d, p in previous.items() if p is None]
    while current:  # walk the chain from the first stage
        ordered += current
        current = [d for d, p in previous.items() if p in current and d not in ordered]
    return ordered + [d for d in configs if d not in ordered]
