"""A committed checkpoint of any layout as one plain model, in one process.

Export, generation and ``megatrain eval`` start here. A checkpoint step holds one model file per
(pipeline, tensor) shard, ``model-ppXX-tpYY.safetensors``, named as that rank's module names
them (``checkpoint/files.py``, ``checkpoint/state.py``). ``full_state_dict`` reads every shard
(checking each file's size and sha256 against the manifest), renames pipeline-stage names back to
the plain model's, and concatenates tensor-parallel slices along the dimension they were cut
(the fused q/k/v projection was cut per block of three: ``parallel/tensor_parallel.py``). An
expert-parallel step adds ``model-ppXX-tpYY-epEE.safetensors``, EP rank e's slice of the routed
experts (``checkpoint/experts.py``): the slices are joined in EP rank order (numbers, not strings:
ep100 comes after ep11), and a step missing one EP rank's file is refused (``IncompleteCheckpoint``).

What rebuilds the model is the run record ``run.json`` (the resolved config and the shard
version), which rank 0 writes at the start of every run into the run dir and beside the
checkpoints in the durable URL, with a copy of the tokenizer and of what an export says about it
(``hf_tokenizer.snapshot``: a base model's special tokens and chat template), so a checkpoint URL
alone is enough. Its paths are absolute; read from a run dir, they are taken where the run dir
lies now (``megatrain/config/run_dirs.py``: a moved run dir still finds its checkpoints). ``load_run``
accepts a run dir, a campaign's stage dir, a campaign dir (its final stage), a durable checkpoint
URL or one ``step-*`` directory, from any working directory.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain import storage
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import load_safetensors, model_file, parse_step
from megatrain.checkpoint.restore import read_verified
from megatrain.config import CheckpointingPolicy, Config
from megatrain.config.campaign import stage_dirs
from megatrain.config.run_dirs import (
    RUN_RECORD,
    RunDir,
    absolute,
    absolute_locations,
    find_run_dir,
    read_run_dir,
)
from megatrain.data.index import TOKENIZER_NAME, ShardIndex
from megatrain.errors import InputError, one_line
from megatrain.interop import hf_tokenizer

log = logging.getLogger("megatrain.interop")

# -epEE: an expert-parallel run's file of EP rank e's slice of the routed experts (checkpoint/experts.py)
_MODEL_FILE = re.compile(r"^model-pp(\d+)-tp(\d+)(?:-ep(\d+))?\.safetensors$")


class RunNotFound(InputError):
    """No checkpoint, or no run record to rebuild its model from; the message says where it looked."""


class IncompleteCheckpoint(InputError):
    """A step whose expert-parallel model files do not hold every expert (an EP rank's file missing)."""


def write_run_record(cfg: Config, index: ShardIndex) -> None:
    """Rank 0, at the start of a run: the resolved config and the shard version, in the run dir
    and beside the checkpoints (with the tokenizer). Every local path in it is absolute (a reader
    runs from any folder, ``run_dirs.relocate`` follows a moved run dir). A failure beside the
    checkpoints only costs a warning here: it matters to export and generation, not to training."""
    record = {"config": absolute_locations(cfg.model_dump(mode="json")), "data_index": absolute(index.url),
              "tokenizer": TOKENIZER_NAME, "eos_id": index.eos_id, "bos_id": index.bos_id}
    data = json.dumps(record, indent=1).encode()
    Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
    storage.write_bytes(str(Path(cfg.train.run_dir) / RUN_RECORD), data)  # whole or not at all: readers trust it
    try:
        storage.write_bytes(storage.join_url(cfg.checkpoint.durable_url, RUN_RECORD), data)
        tokenizer = storage.read_bytes(index.tokenizer_url)
        storage.write_bytes(storage.join_url(cfg.checkpoint.durable_url, TOKENIZER_NAME), tokenizer)
        hf_tokenizer.snapshot(cfg, tokenizer, index.eos_id, index.bos_id)  # the base model's tokenizer files
    except (OSError, ValueError, storage.StorageError, InputError) as exc:
        log.warning("could not write the run record beside the checkpoints (%s): %s", cfg.checkpoint.durable_url, exc)


def _read_record(url: str) -> dict[str, Any] | None:
    path = storage.join_url(url, RUN_RECORD)
    if not storage.exists(path):
        return None
    try:
        return json.loads(storage.read_bytes(path))
    except ValueError as exc:
        raise RunNotFound(f"{path}: not valid JSON ({exc})") from None


@dataclass
class _Located:
    """What a command's checkpoint argument names."""

    cfg: Config  # the run's config, its own locations where they lie now
    durable: str  # where its checkpoints are
    step_url: str | None  # one step dir, when the argument named one
    data_index: str | None  # the shard version it trained on, as its run.json says
    run: RunDir | None  # the run dir, when one was named (a campaign dir: its final stage's)


def _is_checkpoint_dir(url: str) -> bool:
    """A durable checkpoint URL: step-* dirs, or the tokenizer copy only the record beside checkpoints has."""
    return bool(catalog.list_checkpoints(url)) or storage.exists(storage.join_url(url, TOKENIZER_NAME))


def _locate(checkpoint: str, config: str | None) -> _Located:
    """Resolve what the user pointed at, from any working directory: a step dir, a durable
    checkpoint URL, a run dir, a campaign's stage dir, or a campaign dir (its final stage)."""
    url = checkpoint.rstrip("/") or checkpoint
    if not storage.exists(url):
        raise RunNotFound(f"{checkpoint}: no such run dir or checkpoint URL")
    step_url = url if parse_step(posixpath.basename(url)) is not None else None
    checkpoints = step_url is not None or _is_checkpoint_dir(url)
    run = None if checkpoints else find_run_dir(url)
    if run is not None:  # its record, read against where the run dir lies now
        recorded = run.located()
        durable = recorded["checkpoint"]["durable_url"]
        data_index = run.data_index() or (_read_record(durable) or {}).get("data_index")
    elif checkpoints:  # the record written beside them
        durable = storage.parent_url(url) if step_url else url
        record = _read_record(durable) or {}
        recorded, data_index = record.get("config"), record.get("data_index")
    else:
        raise RunNotFound(f"{checkpoint}: not a run dir (no {RUN_RECORD} or config.yaml), nor a campaign dir (stage folders "
                          "with config.yaml), nor a checkpoint dir (step-* folders)")
    if config is not None:
        from megatrain.config import load_config

        return _Located(load_config(config, []), durable, step_url, data_index, run)
    if recorded is None:
        raise RunNotFound(f"{checkpoint}: no {RUN_RECORD} here or in {durable} (written by runs since megatrain "
                          "wrote it); pass --config with the run's recipe")
    return _Located(Config.model_validate(recorded), durable, step_url, data_index, run)


def _nothing_committed(checkpoint: str, where: _Located, step: int | None) -> str:
    """Why there is no checkpoint to load, in one line; for a campaign, which stages have one."""
    what = f"no committed checkpoint{'' if step is None else f' of step {step}'}"
    if where.run is None or where.run.campaign is None:
        return f"{checkpoint}: {what} in {where.durable}"
    others = []
    for stage in stage_dirs(where.run.campaign)[:-1]:
        run = read_run_dir(stage)
        steps = [i.step for i in catalog.committed(run.where(run.config["checkpoint"]["durable_url"]))] if run else []
        if steps:
            others.append(f"stage {stage.name!r} has step {steps[-1]} ({stage})")
    return (f"{checkpoint}: the campaign's final stage {where.run.path.name!r} has {what} yet in {where.durable}"
            + (f"; {', '.join(others)}" if others else ""))


def _layer_name(name: str, n_layer: int) -> str:
    """A pipeline stage's (or an activation-checkpointed model's) tensor name -> the plain GPT's.
    Stage layers are numbered as in ``GPT.layers()`` plus DeepSpeed's tied copy of the embedding
    (``parallel/pipeline.py``): 0 the embedding, 1..n_layer the blocks, then the head."""
    name = re.sub(r"^blocks\.(\d+)\.block\.", r"blocks.\1.", name)  # CheckpointedBlock wrapper
    if name.startswith("tied_modules.embed."):
        return "embed." + name[len("tied_modules.embed."):]
    match = re.match(r"^(\d+)\.(.*)$", name)
    if not match:
        return name
    layer, rest = int(match.group(1)), match.group(2)
    if rest.startswith("head."):
        return rest
    if layer == 0:
        return "embed." + rest
    if 1 <= layer <= n_layer:
        return f"blocks.{layer - 1}.{rest}"
    raise ValueError(f"checkpoint tensor {name!r}: layer {layer} is not a block of a {n_layer}-layer model")


def fused_blocks(name: str, cfg: Any, rows: int) -> list[int]:
    """The whole-tensor sizes of the fused blocks tensor parallelism cuts one by one
    (``parallel/tensor_parallel.py``): qkv's [q | k | v] (H hd, G hd, G hd), SwiGLU's [gate | up]."""
    if ".attn.qkv." in name:
        kv = (getattr(cfg, "n_kv_head", None) or cfg.n_head) * cfg.head_dim
        return [cfg.n_head * cfg.head_dim, kv, kv]
    if ".mlp.fc." in name and getattr(cfg, "mlp", "gelu") == "swiglu":
        return [rows // 2, rows // 2]
    return [rows]


def _merge_tp(name: str, slices: list[torch.Tensor], full_shape: torch.Size, cfg: Any) -> torch.Tensor:
    """Reassemble a tensor cut over tp ranks (or return a replicated one)."""
    if len(slices) == 1 or slices[0].shape == full_shape:
        return slices[0]
    dims = [d for d in range(len(full_shape)) if slices[0].shape[d] != full_shape[d]]
    if len(dims) != 1 or slices[0].shape[dims[0]] * len(slices) != full_shape[dims[0]]:
        raise ValueError(f"{name}: tp slices of shape {list(slices[0].shape)} do not make {list(full_shape)}")
    dim, world = dims[0], len(slices)
    sizes = fused_blocks(name, cfg, full_shape[dim]) if dim == 0 else [full_shape[dim]]
    per_rank = [s.split([size // world for size in sizes], dim) for s in slices]  # rank r: [block_0_r, block_1_r, ...]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank], dim) for i in range(len(sizes))], dim)


def full_state_dict(step_url: str, manifest: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's tensors from every (pp, tp) model file of a committed step, named and
    shaped as ``model`` (a plain model of the run's config, possibly on the meta device) wants."""
    n_layer = len(model.blocks)
    shards: dict[int, dict[int, dict[str, list[torch.Tensor]]]] = {}  # tp -> pp -> name -> its EP slices
    from_ep: dict[str, tuple[int, int, int]] = {}  # plain name of an expert tensor -> (pp, tp, EP files joined)
    for pp, tp, ep, name in model_files(step_url, manifest):  # in EP rank order: the slices join in expert order
        stage = shards.setdefault(tp, {}).setdefault(pp, {})
        for tensor_name, tensor in load_safetensors(read_verified(step_url, name, manifest)).items():
            stage.setdefault(tensor_name, []).append(tensor)
            if ep is not None:
                from_ep[_layer_name(tensor_name, n_layer)] = (pp, tp, ep + 1)
    if not shards:
        raise RunNotFound(f"{step_url}: the manifest lists no model file")
    by_name: dict[str, list[torch.Tensor]] = {}
    for tp in sorted(shards):
        seen: dict[str, torch.Tensor] = {}
        for pp in sorted(shards[tp]):
            for raw, parts in shards[tp][pp].items():  # the tied embedding: first stage's copy
                seen.setdefault(_layer_name(raw, n_layer), parts[0] if len(parts) == 1 else torch.cat(parts))
        for name, tensor in seen.items():
            by_name.setdefault(name, []).append(tensor)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(by_name)), sorted(set(by_name) - set(expected))
    if missing or extra:
        raise ValueError(f"{step_url}: checkpoint tensors do not fit the config's model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    for name, (pp, tp, ep) in from_ep.items():  # the last EP rank's file missing leaves no gap in the names
        held, want = by_name[name][0].shape[0], expected[name].shape[0]
        if held != want:
            raise IncompleteCheckpoint(f"{step_url}: the {ep} expert-parallel model files of pp {pp} tp {tp} hold "
                                       f"{held} of the {want} experts of {name}: an EP rank's file is missing")
    return {name: _merge_tp(name, by_name[name], expected[name].shape, model.cfg) for name in expected}


def model_files(step_url: str, manifest: dict[str, Any]) -> list[tuple[int, int, int | None, str]]:
    """The step's model files as (pp, tp, EP rank or None, name), ordered by those numbers (as
    strings, ep100 would sort before ep11 and its experts join out of place). Raises
    IncompleteCheckpoint when a (pp, tp) shard's EP ranks are not 0..E-1 without a gap."""
    found = []
    for name in {n for files in manifest["files"].values() for n in files}:
        match = _MODEL_FILE.match(name)
        if match:
            pp, tp, ep = match.groups()
            found.append((int(pp), int(tp), None if ep is None else int(ep), name))
    found.sort(key=lambda f: (f[0], f[1], -1 if f[2] is None else f[2]))
    for pp, tp in sorted({(f[0], f[1]) for f in found}):
        ranks = [f[2] for f in found if (f[0], f[1]) == (pp, tp) and f[2] is not None]
        if ranks != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise IncompleteCheckpoint(f"{step_url}: the expert-parallel model files of pp {pp} tp {tp} miss EP "
                                       f"rank(s) {missing[:8]} of 0..{max(ranks)} (e.g. {model_file(pp, tp, missing[0])})")
    return found


def read_run_config(checkpoint: str, config: str | None = None) -> Config:
    """The config of the run that wrote ``checkpoint`` (see ``load_run``), without reading tensors."""
    return _locate(checkpoint, config).cfg


@dataclass
class LoadedRun:
    cfg: Config
    model: torch.nn.Module  # the plain GPT, fp32, eval mode, on ``device``
    step: int
    step_url: str
    durable_url: str
    device: torch.device
    data_index: str | None = None  # the shard version it trained on (its run.json's data_index)

    def index(self) -> ShardIndex:
        """The shard version this run trained on (its held-out shards, its tokenizer)."""
        from megatrain.data.index import load_index

        if self.data_index:
            return load_index(self.data_index)
        from megatrain.data.shard import (
            component_configs,
            mixture_tokenizer,
            shard_corpus,
        )

        # as the trainer chose: a mixture's heaviest component (the first of the heaviest)
        data = mixture_tokenizer(self.cfg.data, self.cfg.model.vocab_size)
        weights = [c.weight for c in self.cfg.data.components()]
        heaviest = component_configs(data)[weights.index(max(weights))]
        return shard_corpus(heaviest, self.cfg.seq_len, self.cfg.model.vocab_size)

    def tokenizer(self):
        """The run's tokenizer (``tokenizers.Tokenizer``): the copy beside the checkpoints, else the shards'."""
        from tokenizers import Tokenizer

        url, data = self._tokenizer_json()
        try:
            return Tokenizer.from_str(data.decode())
        except Exception as exc:  # noqa: BLE001 (valid JSON tokenizers refuses: its own error names no file)
            raise InputError(f"{url}: not a tokenizer.json that tokenizers reads ({one_line(str(exc))})") from None

    def bos_id(self) -> int | None:
        """The id its documents started with (None: no BOS), as its run record or shard version says."""
        record = _read_record(self.durable_url) or {}
        if "bos_id" in record:
            return record["bos_id"]
        if self.data_index:
            from megatrain.data.index import load_index

            return load_index(self.data_index).bos_id
        return None

    def eos_id(self) -> int | None:
        """The id that ended its documents, as its run record or shard version says."""
        record = _read_record(self.durable_url) or {}
        if record.get("eos_id") is not None:
            return record["eos_id"]
        return self.index().eos_id

    def tokenizer_bytes(self) -> bytes:
        return self._tokenizer_json()[1]

    def _tokenizer_json(self) -> tuple[str, bytes]:
        """(where, bytes) of the run's tokenizer.json, checked to be JSON: a truncated copy fails
        here naming its file, not inside tokenizers ("EOF while parsing", no file named)."""
        url = storage.join_url(self.durable_url, TOKENIZER_NAME)
        if not storage.exists(url):
            url = self.index().tokenizer_url
        data = storage.read_bytes(url)
        try:
            json.loads(data)
        except json.JSONDecodeError as exc:
            raise InputError(f"{url}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                             "truncated or damaged") from None
        except ValueError as exc:  # not UTF-8
            raise InputError(f"{url}: not valid JSON ({exc})") from None
        return url, data


def load_run(checkpoint: str, config: str | None = None, device: str | torch.device = "cpu",
             step: int | None = None) -> LoadedRun:
    """The newest committed checkpoint (or ``step``) under what ``checkpoint`` points at (see
    ``_locate``), as a plain fp32 GPT in eval mode on ``device``."""
    from megatrain.model import GPT

    where = _locate(checkpoint, config)
    infos = catalog.committed(where.durable)
    if where.step_url is not None:
        infos = [i for i in infos if i.url.rstrip("/") == where.step_url.rstrip("/")]
    if step is not None:
        infos = [i for i in infos if i.step == step]
    if not infos:
        raise RunNotFound(_nothing_committed(checkpoint, where, step))
    info = infos[-1]
    # model_copy does not validate: the policy itself, not its name (a str "none" is truthy)
    model_cfg = where.cfg.model.model_copy(update={"dropout": 0.0, "activation_checkpointing": CheckpointingPolicy(),
                                                   "compile": False})
    with torch.device("meta"):
        skeleton = GPT(model_cfg)
    tensors = full_state_dict(info.url, info.manifest, skeleton)
    model = GPT(model_cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    device = torch.device(device)
    run = LoadedRun(where.cfg, model.to(device).eval(), info.step, info.url, where.durable, device, where.data_index)
    if model_cfg.attention_mask == "document":  # as trained: each token sees only its own document
        model.eos_id = run.eos_id()
    return run
