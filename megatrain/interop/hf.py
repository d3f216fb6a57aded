"""Hugging Face ``transformers`` export and import: one mapping table per family, used both ways.

A megatrain model leaves as a folder ``AutoModelForCausalLM.from_pretrained`` loads (config.json,
model.safetensors with Hugging Face names, the tokenizer files, generation_config.json: the base
model's special tokens, chat template and ids when the run continued one, ``hf_tokenizer.py``), and a
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

- ``mixtral`` / ``qwen2_moe`` / ``glm4_moe`` -> ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` /
  ``Glm4MoeForCausalLM``: ``model.mlp=moe`` on the Llama block (``moe.py``: tables, one tensor per
  expert; ``moe_config.py``: which router, shared experts and routed layers each class computes).
  Mixtral: softmax, renormalised top-k, every layer routed; Qwen2-MoE: softmax either way,
  ``moe_every`` and dense first layers; GLM-4-MoE: sigmoid with the aux-free bias, shared experts.

The MegaScale default (parallel block, learned positions) and the Llama parts in a parallel block
(RMSNorm, SwiGLU) have no transformers architecture: their export is refused.

A family's ``refusal`` names the first field its architecture cannot express; ``family_for``
tries every family and reports why each one refused.

Import is checked whole before a run starts (``megatrain import``: ``hf_import.py``): every key of
config.json mapped or refused (``hf_config.py``, RoPE's spellings in ``hf_rope.py``), every tensor
checked by its Hugging Face name and shape from the safetensors headers (``hf_tensors.py``), the
model's own tokenizer in the recipe. Loading the weights (``load_hf_weights``, when the run
starts) runs the same checks again, then reads only the tensors the table names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatrain.config import ModelConfig
from megatrain.config.run_dirs import CHECKPOINT_HELP
from megatrain.errors import InputError
from megatrain.interop.hf_config import (  # noqa: F401 (re-exported: the import side's names)
    FAMILIES,
    at_seq_len,
    family_for,
    family_of_hf,
    model_config_from_hf,
    read_hf_config,
    read_model,
)
from megatrain.interop.hf_import import HF_PREFIX, import_cli  # noqa: F401 (import_cli: megatrain import's entry)
from megatrain.interop.hf_tensors import (  # noqa: F401
    SAFETENSORS_NAME,
    check_tensors,
    read_hf_tensors,
    read_tensors,
)
from megatrain.interop import hf_tokenizer
from megatrain.interop.hf_tokenizer import ExportTokens
from megatrain.interop.mapping import ExportRefused, ImportMismatch, full_attention
from megatrain.interop.moe_config import dense_width_matters, moe_differences

log = logging.getLogger("megatrain.interop")


# ------------------------------------------------------------------------------------ export


def export_model(model: torch.nn.Module, cfg: ModelConfig, out: str | Path, tokenizer_json: bytes,
                 eos_token: str = "<|endoftext|>", tokens: ExportTokens | None = None,
                 max_positions: int | None = None) -> Path:
    """Write ``model`` (a plain megatrain GPT) as a transformers folder; refuses inexact exports.
    ``tokens``: the tokenizer side (``hf_tokenizer``: a base model's files, when the run continued
    one); default the specials of ``tokenizer_json`` itself, ``eos_token`` ending its documents.
    ``max_positions``: config.json's context, default ``hf_tokenizer.positions``'s."""
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    family = family_for(cfg)
    eos_id = Tokenizer.from_str(tokenizer_json.decode()).token_to_id(eos_token)
    if eos_id is None:
        raise ExportRefused(f"data.eos_token={eos_token!r} is not in the run's tokenizer")
    tokens = tokens or hf_tokenizer.resolve_own(tokenizer_json, eos_token)
    context, note = hf_tokenizer.positions(cfg, tokens.base_positions, max_positions)
    for line in [*tokens.notes, *([note] if note else [])]:
        log.info("export: %s", line)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_class = transformers.AutoConfig.for_model(family.model_type).__class__
    fields = family.hf_config(cfg, eos_id)
    fields.update({k: context for k in hf_tokenizer.POSITION_KEYS if k in fields}, **tokens.ids)
    hf_config = config_class(**fields, architectures=[family.architecture])
    hf_config.save_pretrained(out)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    save_file(family.to_hf(state, cfg), str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    if hf_tokenizer.GENERATION_CONFIG not in tokens.files:  # the base model's, else its ids
        pad = tokens.ids["pad_token_id"]
        transformers.GenerationConfig(bos_token_id=tokens.ids["bos_token_id"], eos_token_id=tokens.ids["eos_token_id"],
                                      pad_token_id=tokens.ids["eos_token_id"] if pad is None else pad,
                                      max_length=cfg.seq_len).save_pretrained(out)
    hf_tokenizer.write(out, tokens, tokenizer_json, context)
    return out


def export_checkpoint(checkpoint: str, out: str | Path, config: str | None = None, step: int | None = None,
                      max_positions: int | None = None) -> Path:
    """A committed checkpoint (any layout) -> a transformers folder, its tokenizer files the run's
    (``hf_tokenizer.for_run``: the base model's when the run continued one)."""
    from megatrain.interop.checkpoint import load_run, read_run_config

    family_for(read_run_config(checkpoint, config).model)  # refuse before reading any tensor
    run = load_run(checkpoint, config=config, step=step)
    tokens = hf_tokenizer.for_run(run)
    path = export_model(run.model, run.cfg.model, out, run.tokenizer_bytes(), run.cfg.data.eos_token, tokens,
                        max_positions)
    log.info("exported step %d of %s as %s to %s (tokenizer files: %s)", run.step, run.step_url,
             family_for(run.cfg.model).architecture, path, tokens.source)
    return path


# ------------------------------------------------------------------------------------ import


def _differences(wanted: dict[str, Any], cfg: ModelConfig, hf_dir: str | Path) -> list[str]:
    """The architecture fields where the recipe's model is not the one config.json describes
    (seq_len and dropout are the recipe's to choose)."""
    moe = moe_differences(wanted, cfg, str(hf_dir)) if "moe" in wanted else []
    if "moe" in wanted and not dense_width_matters(cfg):  # every layer routed: d_ff computes nothing
        wanted = {k: v for k, v in wanted.items() if k != "d_ff"}
    wanted = {k: v for k, v in wanted.items() if k != "moe"}
    ours: dict[str, Any] = {k: getattr(cfg, k, None) for k in wanted}
    ours.update(d_ff=cfg.ffn_dim, n_kv_head=cfg.kv_heads)
    wanted = {**wanted, "n_kv_head": wanted.get("n_kv_head") or wanted["n_head"]}
    if cfg.rope_scaling is not None:
        ours["rope_scaling"] = cfg.rope_scaling.model_dump()
    if wanted.get("rope_scaling") is not None:  # as the recipe spells it: with its rope_type and defaults
        wanted["rope_scaling"] = ModelConfig(position="rope", rope_scaling=wanted["rope_scaling"]).rope_scaling.model_dump()
    if full_attention(cfg):  # a window as long as the context
        ours.update(attention="full", window=None)
    return [f"model.{k}: recipe {ours[k]!r}, {hf_dir} {v!r}" for k, v in wanted.items()
            if k not in ("seq_len", "dropout") and ours[k] != v] + moe


def import_hf_state(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megatrain tensors for a model of ``cfg`` from a transformers folder whose architecture
    and shape must equal ``cfg``'s (the differing fields are named). Every tensor is checked by its
    Hugging Face name and shape before any is read."""
    model = read_model(hf_dir)
    differing = _differences(at_seq_len(model.fields, cfg.seq_len), cfg, hf_dir)
    if cfg.position == "learned" and cfg.seq_len > model.max_positions:
        differing.append(f"model.seq_len: recipe {cfg.seq_len} > the {model.max_positions} learned positions of {hf_dir}")
    if differing:
        raise ImportMismatch(f"{hf_dir} is not the recipe's model: " + "; ".join(differing))
    own = model.model_config()  # the folder's own context: its learned position table is that long
    state = model.family.from_hf(read_tensors(check_tensors(hf_dir, model.family, own)), own)
    if "embed.wpe.weight" in state:  # a shorter context than the checkpoint's: the first positions
        state["embed.wpe.weight"] = state["embed.wpe.weight"][: cfg.seq_len]
    return state


def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Copy a transformers checkpoint's weights into a plain megatrain model (before parallelize)."""
    state = import_hf_state(hf_dir, model.cfg)
    own = model.state_dict()
    if set(own) != set(state):  # the checks above make this a bug, not an input
        raise AssertionError(f"{hf_dir}: tensors missing {sorted(set(own) - set(state))[:3]}, "
                             f"unexpected {sorted(set(state) - set(own))[:3]}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


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
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--step", type=int, help="a committed step; default the newest")
    parser.add_argument("--config", help="the run's config YAML, when the checkpoint has no run.json beside it")
    parser.add_argument("--max-positions", type=int, help="config.json's max_position_embeddings; default the "
                        "trained model.seq_len, or the base model's when longer (RoPE models)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = export_checkpoint(args.checkpoint, args.out, config=args.config, step=args.step,
                                 max_positions=args.max_positions)
    except InputError as exc:
        print(f"megatrain export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}))")
    return 0
