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

A family's ``refusal`` names the first field its architecture cannot express; ``family_for``
tries every family and reports why each one refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megatrain.config import ModelConfig
from megatrain.errors import InputError

log = logging.getLogger("megatrain.interop")

SAFETENSORS_NAME = "model.safetensors"


class ExportRefused(InputError):
    """The model's config has a field no Hugging Face architecture expresses exactly."""


class ImportMismatch(InputError):
    """A transformers checkpoint that megatrain cannot load exactly, or that differs from the recipe."""


@dataclass(frozen=True)
class Rename:
    """One tensor, the same values on both sides; ``{i}`` is the block index. ``transpose``: the
    Hugging Face side stores the matrix as [in, out] (GPT-2's Conv1D)."""

    ours: str
    theirs: str
    transpose: bool = False


def _field(cfg: ModelConfig, name: str, default: Any = None) -> Any:
    """A ModelConfig field that older configs may not have (the Llama knobs)."""
    return getattr(cfg, name, default)


def _full_attention(cfg: ModelConfig) -> bool:
    """Sliding windows at least as long as the context are exactly full causal attention."""
    return cfg.attention == "full" or (cfg.window is not None and cfg.window >= cfg.seq_len)


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # the transformers class export targets
    model_type: str  # config.json's model_type this family imports
    globals: tuple[Rename, ...]
    per_block: tuple[Rename, ...]
    refusal: Callable[[ModelConfig], str | None]  # "model.<field>=<value>: why" or None
    hf_config: Callable[[ModelConfig, int], dict[str, Any]]  # (cfg, eos id) -> config.json fields
    model_config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields

    def renames(self, cfg: ModelConfig) -> list[Rename]:
        out = [r for r in self.globals if cfg.tie_embeddings is False or r.ours != "head.weight"]
        for i in range(cfg.n_layer):
            out += [Rename(r.ours.format(i=i), r.theirs.format(i=i), r.transpose) for r in self.per_block]
        if not cfg.bias:  # then no linear or norm has one
            out = [r for r in out if not r.ours.endswith(".bias")]
        return out

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for r in self.renames(cfg):
            tensor = state[r.ours]
            out[r.theirs] = (tensor.t() if r.transpose else tensor).contiguous()
        return out

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for r in self.renames(cfg):
            if r.theirs not in state:
                raise ImportMismatch(f"the transformers checkpoint has no tensor {r.theirs!r} (needed for {r.ours})")
            tensor = state[r.theirs]
            out[r.ours] = (tensor.t() if r.transpose else tensor).contiguous()
        return out


# ------------------------------------------------------------------------------------ GPT-2


def _gpt2_refusal(cfg: ModelConfig) -> str | None:
    if cfg.block != "serial":
        return f"model.block={cfg.block}: GPT-2 is a serial pre-LN block (and no transformers architecture has a " \
               "parallel block with learned absolute positions)"
    for name, want in (("position", "learned"), ("norm", "layernorm"), ("mlp", "gelu")):
        value = _field(cfg, name, want)
        if value != want:
            return f"model.{name}={value}: GPT-2 has {want}"
    if _field(cfg, "n_kv_head") not in (None, cfg.n_head):
        return f"model.n_kv_head={cfg.n_kv_head}: GPT-2 has no grouped-query attention"
    if not cfg.bias:
        return "model.bias=false: GPT-2's linears and LayerNorms always have biases"
    if not _full_attention(cfg):
        return f"model.attention=sliding (window {cfg.window} < seq_len {cfg.seq_len}): GPT-2 has no sliding window"
    return None


def _gpt2_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": cfg.ffn_dim, "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    }


def _gpt2_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ImportMismatch(f"config.json activation_function={act!r}: megatrain's GeLU is the tanh approximation")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ImportMismatch(f"config.json {flag}=true: megatrain's attention does not do that")
    if hf.get("scale_attn_weights") is False:
        raise ImportMismatch("config.json scale_attn_weights=false: megatrain scales attention by 1/sqrt(head_dim)")
    return {
        "vocab_size": hf["vocab_size"], "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": hf["n_embd"],
        "d_ff": hf.get("n_inner") or 4 * hf["n_embd"], "seq_len": hf["n_positions"], "block": "serial",
        "attention": "full", "bias": True, "tie_embeddings": hf.get("tie_word_embeddings", True),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
    }


GPT2 = Family(
    name="gpt2", architecture="GPT2LMHeadModel", model_type="gpt2",
    globals=(
        Rename("embed.wte.weight", "transformer.wte.weight"),
        Rename("embed.wpe.weight", "transformer.wpe.weight"),
        Rename("head.ln_f.weight", "transformer.ln_f.weight"),
        Rename("head.ln_f.bias", "transformer.ln_f.bias"),
        Rename("head.weight", "lm_head.weight"),
    ),
    per_block=(
        Rename("blocks.{i}.ln1.weight", "transformer.h.{i}.ln_1.weight"),
        Rename("blocks.{i}.ln1.bias", "transformer.h.{i}.ln_1.bias"),
        Rename("blocks.{i}.attn.qkv.weight", "transformer.h.{i}.attn.c_attn.weight", transpose=True),
        Rename("blocks.{i}.attn.qkv.bias", "transformer.h.{i}.attn.c_attn.bias"),
        Rename("blocks.{i}.attn.proj.weight", "transformer.h.{i}.attn.c_proj.weight", transpose=True),
        Rename("blocks.{i}.attn.proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
        Rename("blocks.{i}.ln2.weight", "transformer.h.{i}.ln_2.weight"),
        Rename("blocks.{i}.ln2.bias", "transformer.h.{i}.ln_2.bias"),
        Rename("blocks.{i}.mlp.fc.weight", "transformer.h.{i}.mlp.c_fc.weight", transpose=True),
        Rename("blocks.{i}.mlp.fc.bias", "transformer.h.{i}.mlp.c_fc.bias"),
        Rename("blocks.{i}.mlp.proj.weight", "transformer.h.{i}.mlp.c_proj.weight", transpose=True),
        Rename("blocks.{i}.mlp.proj.bias", "transformer.h.{i}.mlp.c_proj.bias"),
    ),
    refusal=_gpt2_refusal, hf_config=_gpt2_config, model_config=_gpt2_model_config,
)

FAMILIES: tuple[Family, ...] = (GPT2,)


def family_for(cfg: ModelConfig) -> Family:
    """The family that expresses ``cfg`` exactly, or ExportRefused naming the field."""
    reasons = []
    for family in FAMILIES:
        reason = family.refusal(cfg)
        if reason is None:
            return family
        reasons.append(f"{family.architecture}: {reason}")
    raise ExportRefused("no Hugging Face architecture computes this model exactly; " + "; ".join(reasons))


def family_of_hf(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if family.model_type == model_type:
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
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        shard = (hf_dir / name).resolve()
        if shard.parent != hf_dir.resolve():  # a name read from metadata never leaves its folder
            raise ImportMismatch(f"{index}: shard name {name!r} leaves the folder")
        tensors.update(load_file(str(shard)))
    return tensors


def import_hf_state(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megatrain tensors for a model of ``cfg`` from a transformers folder whose architecture
    and shape must equal ``cfg``'s (the differing fields are named)."""
    hf = read_hf_config(hf_dir)
    family = family_of_hf(hf)
    wanted = family.model_config(hf)
    ours = {k: cfg.ffn_dim if k == "d_ff" else getattr(cfg, k, None) for k in wanted}  # d_ff None = its default
    if wanted.get("attention") == "full" and _full_attention(cfg):
        ours["attention"] = "full"  # a window as long as the context
    differing = [f"model.{k}: recipe {ours[k]!r}, {hf_dir} {v!r}" for k, v in wanted.items()
                 if k != "seq_len" and ours[k] != v]
    if cfg.seq_len > wanted.get("seq_len", cfg.seq_len) and "embed.wpe.weight" in {r.ours for r in family.globals}:
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


def init_from_hf(model: torch.nn.Module, init_from: str | None) -> bool:
    """``checkpoint.init_from: hf:<local dir>``: start from a transformers checkpoint (weights
    only; a fresh optimizer). Called on the plain model before it is parallelized; a checkpoint
    of the run's own, restored later, takes precedence. Returns whether it loaded anything."""
    if not init_from or not init_from.startswith(HF_PREFIX):
        return False
    hf_dir = init_from[len(HF_PREFIX):]
    load_hf_weights(model, hf_dir)
    log.info("initialised the model from the transformers checkpoint %s", hf_dir)
    return True


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
