"""Llama and Mistral: the serial RoPE/RMSNorm/SwiGLU block <-> ``LlamaForCausalLM`` / ``MistralForCausalLM``
(see ``hf.py``)."""

from __future__ import annotations

from typing import Any

from megatrain.config import ModelConfig
from megatrain.interop.hf_rope import rope_fields
from megatrain.interop.mapping import (
    Family,
    HFConfig,
    Rename,
    Split,
    field,
    full_attention,
    kv_heads,
)


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """megatrain's fused qkv holds [q | k | v] rows: H hd, G hd, G hd (model/attention.py)."""
    hd = cfg.head_dim
    return cfg.n_head * hd, kv_heads(cfg) * hd, kv_heads(cfg) * hd


def _gate_up_rows(cfg: ModelConfig) -> tuple[int, int]:
    """SwiGLU's fused fc holds [gate | up] rows, ff each (model/mlp.py)."""
    return cfg.ffn_dim, cfg.ffn_dim


def _llama_like_refusal(cfg: ModelConfig, name: str, sliding: bool) -> str | None:
    if cfg.block != "serial":
        return f"model.block={cfg.block}: {name} is a serial pre-norm block"
    for knob, want in (("position", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu")):
        value = field(cfg, knob, "learned" if knob == "position" else None)
        if value != want:
            return f"model.{knob}={value}: {name} has {want}"
    if sliding and cfg.bias:
        return f"model.bias=true: {name} has no biases"
    if not sliding and not full_attention(cfg):
        return f"model.attention=sliding (window {cfg.window} < seq_len {cfg.seq_len}): {name} has no sliding window"
    if sliding and full_attention(cfg):
        return f"model.attention={cfg.attention}: {name} is the sliding-window variant"
    return None


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's RoPE dict (transformers 5's ``rope_parameters``: the type, the base and the
    type's keys; hf_rope.py reads it back)."""
    scaling = field(cfg, "rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling.rope_type == "yarn":
        optional = {k: getattr(scaling, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(scaling, k) is not None}
        return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_position, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "truncate": scaling.truncate, **optional}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def _llama_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": kv_heads(cfg),
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_parameters(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "attention_dropout": 0.0, "bos_token_id": eos_id, "eos_token_id": eos_id,
    }


def _mistral_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    out = {k: v for k, v in _llama_config(cfg, eos_id).items() if k not in ("attention_bias", "mlp_bias")}
    return {**out, "sliding_window": cfg.window}


# transformers' LlamaConfig / MistralConfig defaults of the keys read below (tests compare them)
_LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}
_MISTRAL_DEFAULTS = {
    **{k: v for k, v in _LLAMA_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096,
}


def _llama_model_config(hf: HFConfig, biases: bool = True) -> dict[str, Any]:
    """ModelConfig fields of a Llama config.json (``biases``: the architecture has attention_bias
    and mlp_bias; Mistral has neither key and no biases)."""
    if hf["hidden_act"] != "silu":
        raise hf.refuse("hidden_act", "megatrain's SwiGLU uses silu")
    bias = False
    if biases:
        bias = bool(hf["attention_bias"])
        if bool(hf["mlp_bias"]) != bias:
            raise hf.refuse("mlp_bias", f"differs from attention_bias={bias}: megatrain has one model.bias for every linear")
    return {**llama_block_fields(hf, mlp="swiglu", bias=bias), "d_ff": hf["intermediate_size"]}


def llama_block_fields(hf: HFConfig, mlp: str, bias: bool, partial_default: float = 1.0) -> dict[str, Any]:
    """The ModelConfig fields every Llama-shaped family shares (dense or MoE): a serial RMSNorm/RoPE/
    GQA block whose head_dim is hidden_size / heads, no attention dropout."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hidden // heads):  # absent from some classes: transformers' getattr default
        raise hf.refuse("head_dim", f"megatrain's head_dim is hidden_size / num_attention_heads = {hidden // heads}")
    if hf["attention_dropout"]:
        raise hf.refuse("attention_dropout", "megatrain has no dropout on attention probabilities")
    return {
        "vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "n_head": heads,
        "n_kv_head": hf["num_key_value_heads"] or heads, "d_model": hidden, "seq_len": hf["max_position_embeddings"],
        "block": "serial", "position": "rope", "norm": "rmsnorm", "mlp": mlp, "bias": bias,
        "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_eps": hf["rms_norm_eps"], "attention": "full",
        "window": None, "dropout": 0.0, **rope_fields(hf, partial_default=partial_default),
    }


def _mistral_model_config(hf: HFConfig) -> dict[str, Any]:
    fields = _llama_model_config(hf, biases=False)
    if hf["sliding_window"] is not None:  # null: no window; a window past the context is full attention
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
    model_config=_llama_model_config, defaults=_LLAMA_DEFAULTS, base_prefix="model.",
    neutral={"pretraining_tp": "transformers 4 split each projection into that many slices and summed them: the same "
                               "product"},
    ignored_tensors={r"rotary_emb\.inv_freq$": "RoPE's frequencies, a buffer older transformers saved and recomputes"},
)
# Llama with a sliding window and no biases; the same tensor names
MISTRAL = Family(
    name="mistral", architecture="MistralForCausalLM", model_type="mistral", globals=_LLAMA_GLOBALS,
    per_block=_LLAMA_BLOCK, refusal=lambda cfg: _llama_like_refusal(cfg, "Mistral", sliding=True),
    hf_config=_mistral_config, model_config=_mistral_model_config, defaults=_MISTRAL_DEFAULTS, base_prefix="model.",
    ignored_tensors={r"rotary_emb\.inv_freq$": "RoPE's frequencies, a buffer older transformers saved and recomputes"},
)
