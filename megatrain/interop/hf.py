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


@dataclass(frozen=True)
class Split:
    """One fused megatrain tensor, several Hugging Face tensors: ``ours`` is ``theirs``
    concatenated along dim 0 (rows), ``sizes(cfg)`` rows each (e.g. [q | k | v])."""

    ours: str
    theirs: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]


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
    per_block: tuple[Rename | Split, ...]
    refusal: Callable[[ModelConfig], str | None]  # "model.<field>=<value>: why" or None
    hf_config: Callable[[ModelConfig, int], dict[str, Any]]  # (cfg, eos id) -> config.json fields
    model_config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields

    def entries(self, cfg: ModelConfig) -> list[Rename | Split]:
        """The table for one model: ``{i}`` filled in per block, absent tensors left out."""
        out: list[Rename | Split] = [r for r in self.globals if not cfg.tie_embeddings or r.ours != "head.weight"]
        for i in range(cfg.n_layer):
            for e in self.per_block:
                if isinstance(e, Split):
                    out.append(Split(e.ours.format(i=i), tuple(t.format(i=i) for t in e.theirs), e.sizes))
                else:
                    out.append(Rename(e.ours.format(i=i), e.theirs.format(i=i), e.transpose))
        if not cfg.bias:  # then no linear or norm has one
            out = [e for e in out if not e.ours.endswith(".bias")]
        return out

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.entries(cfg):
            tensor = state[e.ours]
            if isinstance(e, Split):
                out.update(zip(e.theirs, (t.contiguous() for t in tensor.split(e.sizes(cfg), dim=0)), strict=True))
            else:
                out[e.theirs] = (tensor.t() if e.transpose else tensor).contiguous()
        return out

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.entries(cfg):
            names = e.theirs if isinstance(e, Split) else (e.theirs,)
            for name in names:
                if name not in state:
                    raise ImportMismatch(f"the transformers checkpoint has no tensor {name!r} (needed for {e.ours})")
            if isinstance(e, Split):
                out[e.ours] = torch.cat([state[n] for n in names], dim=0)
            else:
                out[e.ours] = (state[e.theirs].t() if e.transpose else state[e.theirs]).contiguous()
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

# ------------------------------------------------------------------------ Llama and Mistral


def _kv_heads(cfg: ModelConfig) -> int:
    return _field(cfg, "n_kv_head") or cfg.n_head


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """megatrain's fused qkv holds [q | k | v] rows: H hd, G hd, G hd (model/attention.py)."""
    hd = cfg.head_dim
    return cfg.n_head * hd, _kv_heads(cfg) * hd, _kv_heads(cfg) * hd


def _gate_up_rows(cfg: ModelConfig) -> tuple[int, int]:
    """SwiGLU's fused fc holds [gate | up] rows, ff each (model/mlp.py)."""
    return cfg.ffn_dim, cfg.ffn_dim


def _llama_like_refusal(cfg: ModelConfig, name: str, sliding: bool) -> str | None:
    if cfg.block != "serial":
        return f"model.block={cfg.block}: {name} is a serial pre-norm block"
    for field, want in (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu")):
        value = _field(cfg, field, "learned" if field == "position" else None)
        if value != want:
            return f"model.{field}={value}: {name} has {want}"
    if sliding and cfg.bias:
        return f"model.bias=true: {name} has no biases"
    if not sliding and not _full_attention(cfg):
        return f"model.attention=sliding (window {cfg.window} < seq_len {cfg.seq_len}): {name} has no sliding window"
    if sliding and _full_attention(cfg):
        return f"model.attention={cfg.attention}: {name} is the sliding-window variant"
    return None


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    scaling = _field(cfg, "rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def _llama_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": _kv_heads(cfg),
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_parameters(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "attention_dropout": 0.0, "bos_token_id": eos_id, "eos_token_id": eos_id,
    }


def _mistral_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    out = {k: v for k, v in _llama_config(cfg, eos_id).items() if k not in ("attention_bias", "mlp_bias")}
    return {**out, "sliding_window": cfg.window}


def _llama_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ImportMismatch(f"config.json hidden_act={hf['hidden_act']!r}: megatrain's SwiGLU uses silu")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ImportMismatch("config.json attention_bias != mlp_bias: megatrain has one model.bias for every linear")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ImportMismatch(f"config.json head_dim={hf['head_dim']}: megatrain's head_dim is hidden_size / heads")
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    fields: dict[str, Any] = {
        "vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "n_head": heads,
        "n_kv_head": hf.get("num_key_value_heads") or heads, "d_model": hidden, "d_ff": hf["intermediate_size"],
        "seq_len": hf.get("max_position_embeddings", 2048), "block": "serial", "position": "rope",
        "norm": "rmsnorm", "mlp": "swiglu", "bias": bool(hf.get("attention_bias", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope["rope_theta"], "attention": "full",
    }
    if rope["rope_type"] == "llama3":
        fields["rope_scaling"] = {"factor": rope["factor"], "low_freq_factor": rope["low_freq_factor"],
                                  "high_freq_factor": rope["high_freq_factor"],
                                  "original_max_position": rope["original_max_position_embeddings"]}
    elif rope["rope_type"] != "default":
        raise ImportMismatch(f"config.json rope_type={rope['rope_type']!r}: megatrain has plain RoPE and llama3 scaling")
    return fields


def _mistral_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    fields = _llama_model_config(hf)
    if hf.get("sliding_window"):
        fields.update(attention="sliding", window=min(hf["sliding_window"], fields["seq_len"]))
    return fields


_LLAMA_GLOBALS = (
    Rename("embed.wte.weight", "model.embed_tokens.weight"),
    Rename("head.ln_f.weight", "model.norm.weight"),
    Rename("head.weight", "lm_head.weight"),
)
_LLAMA_BLOCK = (
    Rename("blocks.{i}.ln1.weight", "model.layers.{i}.input_layernorm.weight"),
    Split("blocks.{i}.attn.qkv.weight", ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                                         "model.layers.{i}.self_attn.v_proj.weight"), _qkv_rows),
    Split("blocks.{i}.attn.qkv.bias", ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
                                       "model.layers.{i}.self_attn.v_proj.bias"), _qkv_rows),
    Rename("blocks.{i}.attn.proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    Rename("blocks.{i}.attn.proj.bias", "model.layers.{i}.self_attn.o_proj.bias"),
    Rename("blocks.{i}.ln2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Split("blocks.{i}.mlp.fc.weight", ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
          _gate_up_rows),
    Split("blocks.{i}.mlp.fc.bias", ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"),
          _gate_up_rows),
    Rename("blocks.{i}.mlp.proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    Rename("blocks.{i}.mlp.proj.bias", "model.layers.{i}.mlp.down_proj.bias"),
)

LLAMA = Family(
    name="llama", architecture="LlamaForCausalLM", model_type="llama", globals=_LLAMA_GLOBALS, per_block=_LLAMA_BLOCK,
    refusal=lambda cfg: _llama_like_refusal(cfg, "Llama", sliding=False), hf_config=_llama_config,
    model_config=_llama_model_config,
)
# Llama with a sliding window and no biases; the same tensor names
MISTRAL = Family(
    name="mistral", architecture="MistralForCausalLM", model_type="mistral", globals=_LLAMA_GLOBALS,
    per_block=_LLAMA_BLOCK, refusal=lambda cfg: _llama_like_refusal(cfg, "Mistral", sliding=True),
    hf_config=_mistral_config, model_config=_mistral_model_config,
)

FAMILIES: tuple[Family, ...] = (GPT2, LLAMA, MISTRAL)


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
