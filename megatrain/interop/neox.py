"""GPT-NeoX: RoPE + LayerNorm + GeLU with biases, serial or parallel block <-> ``GPTNeoXForCausalLM``
(see ``hf.py``)."""

from __future__ import annotations

from typing import Any

from megatrain.config import ModelConfig
from megatrain.interop.hf_rope import rope_fields
from megatrain.interop.mapping import (
    Copies,
    Family,
    HFConfig,
    Rename,
    field,
    full_attention,
    kv_heads,
)


def _neox_refusal(cfg: ModelConfig) -> str | None:
    for knob, want in (("position", "rope"), ("norm", "layernorm"), ("mlp", "gelu")):
        value = field(cfg, knob, "learned" if knob == "position" else None)
        if value != want:
            return f"model.{knob}={value}: GPT-NeoX has {want}"
    if kv_heads(cfg) != cfg.n_head:
        return f"model.n_kv_head={cfg.n_kv_head}: GPT-NeoX has no grouped-query attention"
    if not cfg.bias:
        return "model.bias=false: GPT-NeoX's MLP always has biases"
    if field(cfg, "rope_scaling") is not None:
        return "model.rope_scaling: not exported to GPT-NeoX"
    if not full_attention(cfg):
        return f"model.attention=sliding (window {cfg.window} < seq_len {cfg.seq_len}): GPT-NeoX has no sliding window"
    return None


def _neox_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "intermediate_size": cfg.ffn_dim, "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.seq_len, "layer_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "use_parallel_residual": cfg.block == "parallel",
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0},
        "attention_bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "bos_token_id": eos_id, "eos_token_id": eos_id,
    }


# transformers' GPTNeoXConfig defaults of the keys read below (tests compare them)
_NEOX_DEFAULTS = {
    "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
    "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
    "use_parallel_residual": True, "attention_bias": True, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": None,
}


def _neox_model_config(hf: HFConfig) -> dict[str, Any]:
    if hf["hidden_act"] not in ("gelu_new", "gelu_pytorch_tanh"):
        raise hf.refuse("hidden_act", "megatrain's GeLU is the tanh approximation")
    if not hf["attention_bias"]:
        raise hf.refuse("attention_bias", "megatrain has one model.bias for every linear, and NeoX's MLP has biases")
    for key in ("attention_dropout", "hidden_dropout"):
        if hf[key]:
            raise hf.refuse(key, "megatrain has no dropout inside the blocks")
    # GPT-NeoX spells the base rotary_emb_base and the rotated share rotary_pct, 0.25 when absent
    rope = rope_fields(hf, types=("default",), theta_key="rotary_emb_base", partial_key="rotary_pct",
                       partial_default=0.25)
    return {
        "vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "n_head": hf["num_attention_heads"],
        "n_kv_head": None, "d_model": hf["hidden_size"], "d_ff": hf["intermediate_size"],
        "seq_len": hf["max_position_embeddings"], "block": "parallel" if hf["use_parallel_residual"] else "serial",
        "position": "rope", "norm": "layernorm", "mlp": "gelu", "bias": True, "attention": "full", "window": None,
        "tie_embeddings": bool(hf["tie_word_embeddings"]), "norm_eps": hf["layer_norm_eps"], "dropout": 0.0, **rope,
    }


_NEOX_GLOBALS = (
    Rename("embed.wte.weight", "gpt_neox.embed_in.weight"),
    Rename("head.ln_f.weight", "gpt_neox.final_layer_norm.weight"),
    Rename("head.ln_f.bias", "gpt_neox.final_layer_norm.bias"),
    Rename("head.weight", "lm_head.weight"),
)
_NEOX_ATTN_MLP = (
    Rename("blocks.{i}.attn.qkv.weight", "gpt_neox.layers.{i}.attention.query_key_value.weight", "heads"),
    Rename("blocks.{i}.attn.qkv.bias", "gpt_neox.layers.{i}.attention.query_key_value.bias", "heads"),
    Rename("blocks.{i}.attn.proj.weight", "gpt_neox.layers.{i}.attention.dense.weight"),
    Rename("blocks.{i}.attn.proj.bias", "gpt_neox.layers.{i}.attention.dense.bias"),
    Rename("blocks.{i}.mlp.fc.weight", "gpt_neox.layers.{i}.mlp.dense_h_to_4h.weight"),
    Rename("blocks.{i}.mlp.fc.bias", "gpt_neox.layers.{i}.mlp.dense_h_to_4h.bias"),
    Rename("blocks.{i}.mlp.proj.weight", "gpt_neox.layers.{i}.mlp.dense_4h_to_h.weight"),
    Rename("blocks.{i}.mlp.proj.bias", "gpt_neox.layers.{i}.mlp.dense_4h_to_h.bias"),
)
_NEOX_NEUTRAL = {"classifier_dropout": "the dropout of GPTNeoXForSequenceClassification's head, which a causal LM "
                                        "does not have"}
_NEOX_BUFFERS = {r"\.attention\.(bias|masked_bias)$": "the causal-mask buffers older transformers saved and rebuilds",
                 r"rotary_emb\.inv_freq$": "RoPE's frequencies, a buffer older transformers saved and recomputes"}
_LN1, _LN2 = "gpt_neox.layers.{i}.input_layernorm", "gpt_neox.layers.{i}.post_attention_layernorm"

# x + attn(ln(x)) + mlp(ln(x)): GPT-NeoX's parallel residual with both of its norms set to the one norm
NEOX_PARALLEL = Family(
    name="gpt_neox-parallel", architecture="GPTNeoXForCausalLM", model_type="gpt_neox", globals=_NEOX_GLOBALS,
    per_block=(Copies("blocks.{i}.ln.weight", (f"{_LN1}.weight", f"{_LN2}.weight")),
               Copies("blocks.{i}.ln.bias", (f"{_LN1}.bias", f"{_LN2}.bias")), *_NEOX_ATTN_MLP),
    refusal=lambda cfg: _neox_refusal(cfg) or (None if cfg.block == "parallel" else "model.block=serial"),
    hf_config=_neox_config, model_config=_neox_model_config,
    imports=lambda hf: hf.get("use_parallel_residual", True),
    defaults=_NEOX_DEFAULTS, base_prefix="gpt_neox.", neutral=_NEOX_NEUTRAL, ignored_tensors=_NEOX_BUFFERS,
)
NEOX_SERIAL = Family(
    name="gpt_neox-serial", architecture="GPTNeoXForCausalLM", model_type="gpt_neox", globals=_NEOX_GLOBALS,
    per_block=(Rename("blocks.{i}.ln1.weight", f"{_LN1}.weight"), Rename("blocks.{i}.ln1.bias", f"{_LN1}.bias"),
               Rename("blocks.{i}.ln2.weight", f"{_LN2}.weight"), Rename("blocks.{i}.ln2.bias", f"{_LN2}.bias"),
               *_NEOX_ATTN_MLP),
    refusal=lambda cfg: _neox_refusal(cfg) or (None if cfg.block == "serial" else "model.block=parallel"),
    hf_config=_neox_config, model_config=_neox_model_config,
    imports=lambda hf: not hf.get("use_parallel_residual", True),
    defaults=_NEOX_DEFAULTS, base_prefix="gpt_neox.", neutral=_NEOX_NEUTRAL, ignored_tensors=_NEOX_BUFFERS,
)
