"""``megatrain import --hf DIR [--config base.yaml] [--seq-len N] --out recipe.yaml``: a recipe that
continues pretraining a transformers model, everything about the model checked now rather than
when the run starts.

What the command checks, in order, before it writes anything:

1. config.json: every key mapped to the recipe's ``model`` section exactly, or refused naming the
   key (``hf_config.read_model``; RoPE in every spelling: ``hf_rope``).
2. The weights: every tensor's Hugging Face name, shape and dtype against what config.json makes
   the model hold, from the safetensors headers only (``hf_tensors.check_tensors``). The values are
   read when the run starts (``checkpoint.init_from: hf:<dir>``), checked the same way again.
3. The tokenizer: ``data.tokenizer`` becomes the model folder, so the shards and checkpoints
   record its tokenizer.json's sha256, and the documents end with the EOS (and start with the BOS)
   of config.json's ids, or the import is refused naming both. A folder without a tokenizer keeps
   the base recipe's, with one warning line, only when its vocabulary is the model's (a trained
   ``bpe`` of the model's size included: the warning says its ids are new to the model).

The recipe is the base recipe with the model replaced whole: every architecture field from
config.json (a field the base recipe set and config.json does not, such as a window or RoPE
scaling, is not inherited), and only the base's runtime knobs (kernels, activation checkpointing,
compile) kept, and for a mixture of experts the base's load balancing (``model.moe``'s
load_balance, aux_loss_coef, bias_update_rate, z_loss_coef: they train the router, they compute
nothing). ``model.seq_len`` stays the base recipe's (or ``--seq-len``), one line saying how
many positions the model allows. The run is the recipe's own: ``name`` is the recipe file's stem,
``train.run_dir`` is ``<recipe folder>/runs/<stem>``, and the locations a run owns (checkpoints,
staging, TensorBoard) are dropped so they follow that run dir; the base recipe's would mix two
runs' checkpoints.

What the base recipe brings that is not the model's to say, the data, optimizer and schedule, is
written out and marked for the user to decide, and its caps (``data.max_source_bytes``) are off
unless asked (``hf_recipe.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from megatrain.interop.hf_config import HFModel, at_seq_len, read_model
from megatrain.interop.hf_recipe import Choice, commented_yaml, decisions, drop_caps
from megatrain.interop.hf_tensors import check_tensors
from megatrain.interop.mapping import ImportMismatch

HF_PREFIX = "hf:"  # checkpoint.init_from of a transformers folder
RUNTIME_KNOBS = ("kernels", "activation_checkpointing", "compile")  # how the model runs, not what it computes
# model.moe's load balancing: how the router trains, not what it computes (an imported bias is loaded either way)
MOE_TRAINING_KNOBS = ("load_balance", "aux_loss_coef", "bias_update_rate", "z_loss_coef")
SAMPLE = "Hello world: def f(x): return x + 1"  # text whose encoding shows the tokens a document starts with


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain import", description="A recipe starting from a transformers model.")
    parser.add_argument("--hf", required=True, help="a local transformers folder (config.json + safetensors)")
    parser.add_argument("--config", help="the recipe to start from (data, optimizer, layout); default the defaults")
    parser.add_argument("--seq-len", type=int, help="model.seq_len to train at; default the base recipe's")
    parser.add_argument("--out", required=True, help="the recipe YAML to write; the run is named after it")
    parser.add_argument("--max-source-bytes", type=int, help="data.max_source_bytes: read at most this much of the "
                        "corpus (default: all of it, whatever the base recipe capped)")
    return parser


def _seq_len(model: HFModel, base_model: dict[str, Any], asked: int | None) -> tuple[int, str]:
    """The context to train at, and the line that says where it came from and what the model allows."""
    from megatrain.config import ModelConfig

    if asked:
        seq_len, source = asked, "--seq-len"
    elif "seq_len" in base_model:
        seq_len, source = base_model["seq_len"], "the base recipe's"
    else:
        seq_len, source = ModelConfig().seq_len, "megatrain's default"
    most = model.max_positions
    if seq_len > most and model.fields["position"] == "learned":
        raise ImportMismatch(f"model.seq_len {seq_len} ({source}) exceeds the {most} learned positions of {model.path}: "
                             f"use --seq-len {most} or less")
    if seq_len > most:
        return seq_len, (f"model.seq_len {seq_len} ({source}) exceeds the {most} positions {model.path} was trained "
                         "for: RoPE extrapolates beyond them")
    more = f"; it allows up to {most} (--seq-len N)" if most > seq_len else ""
    return seq_len, f"model.seq_len {seq_len} ({source}){more}"


def _start_tokens(spec: Any) -> list[int]:
    """The ids a document of ``spec`` starts with before its text: data.tokenizer's BOS, and
    whatever the tokenizer's own post-processor puts in front."""
    from megatrain.data.tokenizer import parse

    tokenizer = parse(spec.json_text, spec.source)
    plain, full = tokenizer.encode(SAMPLE, add_special_tokens=False).ids, tokenizer.encode(SAMPLE).ids
    front = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), 0)
    return ([] if spec.bos_id is None else [spec.bos_id]) + full[:front]


def _model_tokenizer(hf_dir: Path, model: HFModel) -> tuple[dict[str, Any], str]:
    """data.tokenizer and data.eos_token for the folder's own tokenizer, checked against config.json."""
    from megatrain.data.tokenizer import (
        CONFIG_FILE,
        TOKENIZER_FILE,
        load_tokenizer,
        parse,
    )

    path = hf_dir / TOKENIZER_FILE
    tokenizer = parse(path.read_text(), str(path))
    eos_token = tokenizer.id_to_token(model.eos_ids[0]) if model.eos_ids else "<|endoftext|>"
    if eos_token is None:
        raise ImportMismatch(f"{model.path}: eos_token_id={model.eos_ids[0]} is not a token of {path}")
    spec = load_tokenizer(str(hf_dir), eos_token, model.fields["vocab_size"])
    if model.eos_ids and spec.eos_id not in model.eos_ids:  # tokenizer_config.json's eos_token wins in the data
        raise ImportMismatch(f"{hf_dir / CONFIG_FILE}: eos_token {tokenizer.id_to_token(spec.eos_id)!r} (id {spec.eos_id}) "
                             f"is not {model.path}'s eos_token_id {list(model.eos_ids)}: documents would end with "
                             "another token than the model's")
    start = _start_tokens(spec)
    if model.bos_id is not None and start and start[0] != model.bos_id:
        raise ImportMismatch(f"{hf_dir}: documents would start with {tokenizer.id_to_token(start[0])!r} (id {start[0]}), "
                             f"{model.path} has bos_token_id {model.bos_id}")
    bos = f"BOS {tokenizer.id_to_token(start[0])!r}" if start else "no BOS"
    line = (f"data.tokenizer {hf_dir} (sha256 {spec.sha256[:16]}..., {bos}, EOS {tokenizer.id_to_token(spec.eos_id)!r}, "
            f"as {model.path} says)")
    return {"tokenizer": str(hf_dir), "eos_token": tokenizer.id_to_token(spec.eos_id)}, line


def _vocab_agrees(tokens: int, rows: int) -> bool:
    """A model's embedding has the tokenizer's rows, or pads them to a multiple of 64, 128 or 256
    (for GEMM speed; GPT-NeoX pads 50277 to 50304)."""
    return tokens == rows or any(rows == -(-tokens // m) * m for m in (64, 128, 256))


def _base_tokenizer(hf_dir: Path, model: HFModel, base_data: dict[str, Any]) -> str:
    """The warning line for keeping the base recipe's tokenizer, when its vocabulary is the model's."""
    from megatrain.config import DataConfig
    from megatrain.data.tokenizer import load_tokenizer

    data = DataConfig(**{k: v for k, v in base_data.items() if k in ("tokenizer", "eos_token", "bpe_vocab_size")})
    rows = model.fields["vocab_size"]
    if data.tokenizer == "bpe":  # trained on the corpus when sharding: data.bpe_vocab_size, else the model's rows
        tokens, what = data.bpe_vocab_size or rows, "=bpe, trained on the corpus (its ids are not the ones the model learned)"
    else:
        tokens, what = load_tokenizer(data.tokenizer, data.eos_token, rows).vocab_size, f" {data.tokenizer}"
    if not _vocab_agrees(tokens, rows):
        raise ImportMismatch(f"{hf_dir}: no tokenizer.json, and the base recipe's data.tokenizer{what.split(',')[0]} has "
                             f"{tokens} tokens where {model.path} has vocab_size {rows}: not the model's")
    return (f"warning: {hf_dir} has no tokenizer.json: the recipe keeps data.tokenizer{what} "
            f"({tokens} tokens for the model's {rows} rows)")


def build_recipe(hf_dir: Path, model: HFModel, base: dict[str, Any], out: Path, seq_len: int | None = None,
                 base_name: str = "megatrain's defaults", caps: dict[str, int | None] | None = None
                 ) -> tuple[dict[str, Any], list[str], list[str], list[Choice]]:
    """(recipe, lines to print, warning lines, the values the user must decide): the base recipe
    continued from ``model``, its caps off unless ``caps`` asks for them (``hf_recipe``)."""
    from megatrain.config.run_dirs import OWN_LOCATIONS
    from megatrain.data.tokenizer import TOKENIZER_FILE

    recipe = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    base_model = recipe.get("model") or {}
    seq_len, seq_line = _seq_len(model, base_model, seq_len)
    recipe["model"] = {**{k: base_model[k] for k in RUNTIME_KNOBS if k in base_model}, **at_seq_len(model.fields, seq_len)}
    base_moe = base_model.get("moe") or {}
    if "moe" in recipe["model"] and base_moe:
        recipe["model"]["moe"] = {**recipe["model"]["moe"], **{k: base_moe[k] for k in MOE_TRAINING_KNOBS if k in base_moe}}
    lines, warnings = [seq_line], []
    if (hf_dir / TOKENIZER_FILE).is_file():
        data, line = _model_tokenizer(hf_dir, model)
        recipe["data"] = {**(recipe.get("data") or {}), **data}
        lines.append(line)
    else:
        warnings.append(_base_tokenizer(hf_dir, model, recipe.get("data") or {}))
    recipe["name"] = out.stem
    recipe["train"] = {**(recipe.get("train") or {}), "run_dir": str(out.parent / "runs" / out.stem)}
    for section, key in OWN_LOCATIONS:  # they follow train.run_dir (schema.Config)
        (recipe.get(section) or {}).pop(key, None)
    recipe["checkpoint"] = {**(recipe.get("checkpoint") or {}), "init_from": f"{HF_PREFIX}{hf_dir}"}
    lines += drop_caps(recipe, base_name, caps or {})
    return recipe, lines, warnings, decisions(recipe, base, base_name)


def import_cli(argv: list[str]) -> int:
    """``megatrain import``: write the recipe, or fail in one line naming the key, tensor or file."""
    from pydantic import ValidationError

    from megatrain.config import Config, ConfigError, read_yaml
    from megatrain.config.load import format_validation_error

    args = _parser().parse_args(argv)
    hf_dir = Path(args.hf).resolve()
    model = read_model(args.hf)  # every config.json key mapped or refused
    check_tensors(args.hf, model.family, model.model_config())  # every tensor by its name, shape and dtype
    out = Path(args.out).resolve()
    base_name = args.config or "megatrain's defaults"
    recipe, lines, warnings, choices = build_recipe(hf_dir, model, read_yaml(args.config) if args.config else {}, out,
                                                    args.seq_len, base_name, {"max_source_bytes": args.max_source_bytes})
    try:
        Config.model_validate(recipe)  # the recipe validates before it is written
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"{out} (as it would be written)", exc, Config)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    header = [f"megatrain import --hf {hf_dir}" + (f" --config {args.config}" if args.config else ""),
              f"model: all of {model.path}",
              f"data, optimizer and schedule: from {base_name}, a recipe not written for this model",
              "each value marked 'decide' is yours to set (megatrain import printed the same list)"]
    out.write_text(commented_yaml(recipe, choices, header))
    for line in warnings:
        print(line, file=sys.stderr)
    print(f"wrote {out}: {model.family.architecture} -> megatrain, run dir {recipe['train']['run_dir']} "
          f"(train it with: megatrain train --config {args.out})")
    for line in lines:
        print(f"  {line}")
    print(f"  {len(choices)} values to decide for this model, marked in {out.name}:")
    for choice in choices:
        print(f"    {choice.line}")
    return 0
