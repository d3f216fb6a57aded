"""A committed checkpoint of any layout as one plain model, in one process.

Export, generation and ``megatrain eval`` start here. A checkpoint step holds one model file per
(pipeline, tensor) shard, ``model-ppXX-tpYY.safetensors``, named as that rank's module names
them (``checkpoint/files.py``, ``checkpoint/state.py``). ``full_state_dict`` reads every shard
(checking each file's size and sha256 against the manifest), renames pipeline-stage names back to
the plain model's, and concatenates tensor-parallel slices along the dimension they were cut
(the fused q/k/v projection was cut per block of three: ``parallel/tensor_parallel.py``).

What rebuilds the model is the run record ``run.json`` (the resolved config and the shard
version), which rank 0 writes at the start of every run into the run dir and beside the
checkpoints in the durable URL, with a copy of the tokenizer, so a checkpoint URL alone is
enough: ``load_run`` accepts a run dir, a durable checkpoint URL or one ``step-*`` directory.
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
from megatrain.checkpoint.files import load_safetensors, parse_step
from megatrain.checkpoint.restore import read_verified
from megatrain.config import Config
from megatrain.data.index import TOKENIZER_NAME, ShardIndex
from megatrain.errors import InputError

log = logging.getLogger("megatrain.interop")

RUN_RECORD = "run.json"
_MODEL_FILE = re.compile(r"^model-pp(\d+)-tp(\d+)\.safetensors$")


class RunNotFound(InputError):
    """No checkpoint, or no run record to rebuild its model from; the message says where it looked."""


def write_run_record(cfg: Config, index: ShardIndex) -> None:
    """Rank 0, at the start of a run: the resolved config and the shard version, in the run dir
    and beside the checkpoints (with the tokenizer). A failure only costs a warning here: it
    matters to export and generation, not to training."""
    record = {"config": cfg.model_dump(mode="json"), "data_index": index.url, "tokenizer": TOKENIZER_NAME}
    data = json.dumps(record, indent=1).encode()
    Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.train.run_dir) / RUN_RECORD).write_bytes(data)
    try:
        storage.write_bytes(storage.join_url(cfg.checkpoint.durable_url, RUN_RECORD), data)
        tokenizer = storage.read_bytes(index.tokenizer_url)
        storage.write_bytes(storage.join_url(cfg.checkpoint.durable_url, TOKENIZER_NAME), tokenizer)
    except (OSError, storage.StorageError) as exc:
        log.warning("could not write the run record beside the checkpoints (%s): %s", cfg.checkpoint.durable_url, exc)


def _read_record(url: str) -> dict[str, Any] | None:
    path = storage.join_url(url, RUN_RECORD)
    return json.loads(storage.read_bytes(path)) if storage.exists(path) else None


def _locate(checkpoint: str, config: str | None) -> tuple[Config, str, str | None]:
    """(config, durable URL, step URL or None) for what the user pointed at."""
    url = checkpoint.rstrip("/")
    if not storage.exists(url):
        raise RunNotFound(f"{checkpoint}: no such run dir or checkpoint URL")
    step_url = url if parse_step(posixpath.basename(url)) is not None else None
    durable = storage.parent_url(url) if step_url else url
    record = _read_record(durable)
    if step_url is None and record is not None and not catalog.committed(url):
        durable = record["config"]["checkpoint"]["durable_url"]  # a run dir: its record names the checkpoints
    if config is not None:
        from megatrain.config import load_config

        cfg = load_config(config, [])
    elif record is not None:
        cfg = Config.model_validate(record["config"])
    else:
        raise RunNotFound(f"{checkpoint}: no {RUN_RECORD} here or in {durable} (written by runs since megatrain "
                          "wrote it); pass --config with the run's recipe")
    return cfg, durable, step_url


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
    shards: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name in sorted({n for files in manifest["files"].values() for n in files}):
        match = _MODEL_FILE.match(name)
        if match:
            pp, tp = int(match.group(1)), int(match.group(2))
            shards.setdefault(tp, {})[pp] = load_safetensors(read_verified(step_url, name, manifest))
    if not shards:
        raise RunNotFound(f"{step_url}: the manifest lists no model file")
    by_name: dict[str, list[torch.Tensor]] = {}
    for tp in sorted(shards):
        seen: dict[str, torch.Tensor] = {}
        for pp in sorted(shards[tp]):
            for raw, tensor in shards[tp][pp].items():
                seen.setdefault(_layer_name(raw, n_layer), tensor)  # the tied embedding: first stage's copy
        for name, tensor in seen.items():
            by_name.setdefault(name, []).append(tensor)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(by_name)), sorted(set(by_name) - set(expected))
    if missing or extra:
        raise ValueError(f"{step_url}: checkpoint tensors do not fit the config's model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    return {name: _merge_tp(name, by_name[name], expected[name].shape, model.cfg) for name in expected}


def read_run_config(checkpoint: str, config: str | None = None) -> Config:
    """The config of the run that wrote ``checkpoint`` (see ``load_run``), without reading tensors."""
    return _locate(checkpoint, config)[0]


@dataclass
class LoadedRun:
    cfg: Config
    model: torch.nn.Module  # the plain GPT, fp32, eval mode, on ``device``
    step: int
    step_url: str
    durable_url: str
    device: torch.device

    def index(self) -> ShardIndex:
        """The shard version this run trained on (its held-out shards, its tokenizer)."""
        from megatrain.data.index import load_index

        record = _read_record(self.durable_url) or {}
        if record.get("data_index"):
            return load_index(record["data_index"])
        from megatrain.data.shard import component_configs, mixture_tokenizer, shard_corpus

        # as the trainer chose: a mixture's heaviest component (the first of the heaviest)
        data = mixture_tokenizer(self.cfg.data, self.cfg.model.vocab_size)
        weights = [c.weight for c in self.cfg.data.components()]
        heaviest = component_configs(data)[weights.index(max(weights))]
        return shard_corpus(heaviest, self.cfg.seq_len, self.cfg.model.vocab_size)

    def tokenizer(self):
        """The run's tokenizer (``tokenizers.Tokenizer``): the copy beside the checkpoints, else the shards'."""
        from tokenizers import Tokenizer

        url = storage.join_url(self.durable_url, TOKENIZER_NAME)
        if not storage.exists(url):
            url = self.index().tokenizer_url
        return Tokenizer.from_str(storage.read_bytes(url).decode())

    def tokenizer_bytes(self) -> bytes:
        url = storage.join_url(self.durable_url, TOKENIZER_NAME)
        return storage.read_bytes(url if storage.exists(url) else self.index().tokenizer_url)


def load_run(checkpoint: str, config: str | None = None, device: str | torch.device = "cpu",
             step: int | None = None) -> LoadedRun:
    """The newest committed checkpoint (or ``step``) under what ``checkpoint`` points at, as a
    plain fp32 GPT in eval mode on ``device``."""
    from megatrain.model import GPT

    cfg, durable, step_url = _locate(checkpoint, config)
    infos = catalog.committed(durable)
    if step_url is not None:
        infos = [i for i in infos if i.url.rstrip("/") == step_url.rstrip("/")]
    if step is not None:
        infos = [i for i in infos if i.step == step]
    if not infos:
        raise RunNotFound(f"{checkpoint}: no committed checkpoint{'' if step is None else f' of step {step}'} in {durable}")
    info = infos[-1]
    model_cfg = cfg.model.model_copy(update={"dropout": 0.0, "activation_checkpointing": False, "compile": False})
    with torch.device("meta"):
        skeleton = GPT(model_cfg)
    tensors = full_state_dict(info.url, info.manifest, skeleton)
    model = GPT(model_cfg)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    device = torch.device(device)
    return LoadedRun(cfg, model.to(device).eval(), info.step, info.url, durable, device)
