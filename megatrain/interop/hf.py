"""Hugging Face ``transformers`` export and import: one mapping table per family, used both ways.

A megatrain model leaves as a folder ``AutoModelForCausalLM.from_pretrained`` loads (config.json,
model.safetensors with Hugging Face names, the tokenizer files, generation_config.json), and a
transformers checkpoint of a supported architecture comes back as megatrain weights
(``checkpoint.init_from: hf:<dir>``). Only exact conversions exist: a model whose math no
Hugging Face architecture computes is refused with the config field that has no equivalent.

Families (``FAMILIES``), each a table of (megatrain name, Hugging Face name, how the tensor changes):

- ``gpt2`` -> ``GPT2LMHeadModel``: the serial pre-LN GPT with learned positions, LayerNorm, tanh
  GeLU and biases. GPT-2's ``Conv1D`` stores weights as [in, out]: every linear is transposed.
  The fused q/k/v projection has the same [q | k | v] layout on both sides.
- ``llama`` -> ``LlamaForCausalLM``: the serial block with RoPE (the same rotate-half layout, so
  no permutation), RMSNorm, SwiGLU and any n_kv_head; biases on every linear or none
  (attention_bias = mlp_bias). megatrain's fused qkv rows are [q | k | v] (H hd, G hd, G hd) and
  SwiGLU's fused fc rows [gate | up]: each is split into Hugging Face's separate projections.
- ``mistral`` -> ``MistralForCausalLM``: the same with a sliding window (window < seq_len) and no
  biases; Hugging Face's window w lets query i see keys i - w < j <= i, megatrain's convention.
- ``gpt_neox`` -> ``GPTNeoXForCausalLM``: RoPE with LayerNorm, tanh GeLU and biases, multi-head;
  the serial block (``use_parallel_residual=false``) or MegaScale's parallel block, whose one norm
  is written to both of NeoX's (``use_parallel_residual=true`` computes x + attn(ln1(x)) +
  mlp(ln2(x)): exact when ln1 = ln2). NeoX's fused qkv holds its rows per head.

The MegaScale default (parallel block, learned positions) and the Llama parts in a parallel block
(RMSNorm, SwiGLU) have no transformers architecture: their export is refused.

A family's ``refusal`` names the first field its architecture cannot express; ``family_for``
tries every family and reports why each one refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatrain import storage
from megatrain.config import ModelConfig
from megatrain.errors import InputError
from megatrain.interop.gpt2 import GPT2
from megatrain.interop.llama import LLAMA, MISTRAL
from megatrain.interop.mapping import ExportRefused, Family, ImportMismatch, full_attention
from megatrain.interop.neox import NEOX_PARALLEL, NEOX_SERIAL

log = logging.getLogger("megatrain.interop")

SAFETENSORS_NAME = "model.safetensors"


FAMILIES: tuple[Family, ...] = (GPT2, LLAMA, MISTRAL, NEOX_SERIAL, NEOX_PARALLEL)


def family_for(cfg: ModelConfig) -> Family:
    """The family that expresses ``cfg`` exactly, or ExportRefused naming the field."""
    reasons: dict[str, str] = {}  # architecture -> its first reason (GPT-NeoX has two families)
    for family in FAMILIES:
        reason = family.refusal(cfg)
        if reason is None:
            return family
        reasons.setdefault(family.architecture, reason)
    raise ExportRefused("no Hugging Face architecture computes this model exactly; "
                        + "; ".join(f"{arch}: {why}" for arch, why in reasons.items()))


def family_of_hf(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if family.model_type == model_type and family.imports(hf_config):
            return family
    raise ImportMismatch(f"config.json model_type={model_type!r}: megatrain imports "
                         f"{', '.join(f.model_type for f in FAMILIES)}")


# ------------------------------------------------------------------------------------ export


def _write_tokenizer(out: Path, tokenizer_json: bytes, eos_token: str, max_length: int) -> None:
    """tokenizer.json as the run trained it, plus the files AutoTokenizer reads beside it."""
    (out / "tokenizer.json").write_bytes(tokenizer_json)
    special = {"bos_token": eos_token, "eos_token": eos_token, "unk_token": eos_token}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def export_model(model: torch.nn.Module, cfg: ModelConfig, out: str | Path, tokenizer_json: bytes,
                 eos_token: str = "<|endoftext|>") -> Path:
    """Write ``model`` (a plain megatrain GPT) as a transformers folder; refuses inexact exports."""
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    family = family_for(cfg)
    eos_id = Tokenizer.from_str(tokenizer_json.decode()).token_to_id(eos_token)
    if eos_id is None:
        raise ExportRefused(f"data.eos_token={eos_token!r} is not in the run's tokenizer")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_class = transformers.AutoConfig.for_model(family.model_type).__class__
    hf_config = config_class(**family.hf_config(cfg, eos_id), architectures=[family.architecture])
    hf_config.save_pretrained(out)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    save_file(family.to_hf(state, cfg), str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    transformers.GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                                  max_length=cfg.seq_len).save_pretrained(out)
    _write_tokenizer(out, tokenizer_json, eos_token, cfg.seq_len)
    return out


def export_checkpoint(checkpoint: str, out: str | Path, config: str | None = None, step: int | None = None) -> Path:
    """A committed checkpoint (any layout) -> a transformers folder."""
    from megatrain.interop.checkpoint import load_run, read_run_config

    family_for(read_run_config(checkpoint, config).model)  # refuse before reading any tensor
    run = load_run(checkpoint, config=config, step=step)
    path = export_model(run.model, run.cfg.model, out, run.tokenizer_bytes(), run.cfg.data.eos_token)
    log.info("exported step %d of %s as %s to %s", run.step, run.step_url, family_for(run.cfg.model).architecture, path)
    return path


# ------------------------------------------------------------------------------------ import


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ImportMismatch(f"{hf_dir}: no config.json (a transformers model folder, saved with save_pretrained)")
    return json.loads(path.read_text())


def model_config_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """The ``model`` fields of a recipe that match a transformers folder (``model.<k>=<v>`` overrides)."""
    hf = read_hf_config(hf_dir)
    return family_of_hf(hf).model_config(hf)


def read_hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers folder: one model.safetensors or an indexed set of shards."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    single = hf_dir / SAFETENSORS_NAME
    if single.is_file():
        return load_file(str(single))
    index = hf_dir / "model.safetensors.index.json"
    if not index.is_file():
        raise ImportMismatch(f"{hf_dir}: no {SAFETENSORS_NAME} or model.safetensors.index.json (safetensors only, no pickle)")
    tensors: dict[str, torch.Tensor] = {}
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ImportMismatch(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from exc
    for name in sorted(names, key=str):
        shard = storage.confined(str(hf_dir), name, str(index))  # a name read from metadata never leaves its folder
        tensors.update(load_file(shard))
    return tensors


def import_hf_state(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megatrain tensors for a model of ``cfg`` from a transformers folder whose architecture
    and shape must equal ``cfg``'s (the differing fields are named)."""
    hf = read_hf_config(hf_dir)
    family = family_of_hf(hf)
    wanted = family.model_config(hf)
    ours = {k: cfg.ffn_dim if k == "d_ff" else getattr(cfg, k, None) for k in wanted}  # d_ff None = its default
    ours = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in ours.items()}  # rope_scaling
    if wanted.get("attention") == "full" and full_attention(cfg):
        ours["attention"] = "full"  # a window as long as the context
    differing = [f"model.{k}: recipe {ours[k]!r}, {hf_dir} {v!r}" for k, v in wanted.items()
                 if k != "seq_len" and ours[k] != v]
    if cfg.seq_len > wanted.get("seq_len", cfg.seq_len) and "embed.wpe.weight" in {e.ours for e in family.globals}:
        differing.append(f"model.seq_len: recipe {cfg.seq_len} > the {wanted['seq_len']} learned positions of {hf_dir}")
    if differing:
        raise ImportMismatch(f"{hf_dir} is not the recipe's model: " + "; ".join(differing))
    state = family.from_hf(read_hf_tensors(hf_dir), cfg)
    if "embed.wpe.weight" in state:  # a shorter context than the checkpoint's: the first positions
        state["embed.wpe.weight"] = state["embed.wpe.weight"][: cfg.seq_len]
    return state


def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Copy a transformers checkpoint's weights into a plain megatrain model (before parallelize)."""
    state = import_hf_state(hf_dir, model.cfg)
    own = model.state_dict()
    if set(own) != set(state):
        raise ImportMismatch(f"{hf_dir}: tensors missing {sorted(set(own) - set(state))[:3]}, "
                             f"unexpected {sorted(set(state) - set(own))[:3]}")
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != state[name].shape:
                raise ImportMismatch(f"{hf_dir}: {name} is {list(state[name].shape)}, the recipe's model {list(tensor.shape)}")
            tensor.copy_(state[name])


HF_PREFIX = "hf:"


def hf_weights(init_from: str | None) -> Callable[[torch.nn.Module], None] | None:
    """``checkpoint.init_from: hf:<local dir>``: the function that loads that transformers checkpoint
    into a plain model (weights only; a fresh optimizer), for ``build_parallel_model`` to call before
    it parallelizes; None for any other ``init_from``. A checkpoint of the run's own, restored
    later, takes precedence."""
    if not init_from or not init_from.startswith(HF_PREFIX):
        return None
    hf_dir = init_from[len(HF_PREFIX):]

    def load(model: torch.nn.Module) -> None:
        load_hf_weights(model, hf_dir)
        log.info("initialised the model from the transformers checkpoint %s", hf_dir)
    return load


def cli(argv: list[str]) -> int:
    """``megatrain export --checkpoint <dir> --format hf --out <dir>``"""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="megatrain export", description="Export a committed checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="a run dir, a durable checkpoint URL or one step-* dir")
    parser.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--step", type=int, help="a committed step; default the newest")
    parser.add_argument("--config", help="the run's config YAML, when the checkpoint has no run.json beside it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = export_checkpoint(args.checkpoint, args.out, config=args.config, step=args.step)
    except InputError as exc:
        print(f"megatrain export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}))")
    return 0


def import_cli(argv: list[str]) -> int:
    """``megatrain import --hf <dir> [--config base.yaml] --out recipe.yaml``: a recipe that
    continues pretraining from a transformers checkpoint (its model section and
    ``checkpoint.init_from: hf:<dir>``); the weights are read when the run starts."""
    import argparse
    import sys

    import yaml

    parser = argparse.ArgumentParser(prog="megatrain import", description="A recipe starting from a transformers model.")
    parser.add_argument("--hf", required=True, help="a local transformers folder (config.json + safetensors)")
    parser.add_argument("--config", help="the recipe to start from (data, optimizer, layout); default the defaults")
    parser.add_argument("--out", required=True, help="the recipe YAML to write")
    args = parser.parse_args(argv)
    from megatrain.config import ConfigError, load_config, read_yaml

    try:
        fields = model_config_from_hf(args.hf)
        read_hf_tensors(args.hf)  # fail now, not at the run's start, on a folder without weights
        raw = read_yaml(args.config) if args.config else {}
        raw.setdefault("model", {}).update(fields)
        raw.setdefault("checkpoint", {})["init_from"] = f"{HF_PREFIX}{Path(args.hf).resolve()}"
        Path(args.out).write_text(yaml.safe_dump(raw, sort_keys=False))
        load_config(args.out, [])  # the written recipe validates
    except (InputError, ConfigError) as exc:
        print(f"megatrain import: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {family_of_hf(read_hf_config(args.hf)).architecture} -> megatrain "
          f"(train it with: megatrain train --config {args.out})")
    return 0
