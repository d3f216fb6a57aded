"""GPT-2: megatrain's serial GPT <-> ``GPT2LMHeadModel`` (see ``hf.py`` for what each family covers)."""

from __future__ import annotations

import logging
from typing import Any

from megatrain.config import ModelConfig
from megatrain.interop.mapping import Family, HFConfig, Rename, field, full_attention

log = logging.getLogger("megatrain.interop")


def _gpt2_refusal(cfg: ModelConfig) -> str | None:
    if cfg.block != "serial":
        return f"model.block={cfg.block}: GPT-2 is a serial pre-LN block (and no transformers architecture has a " \
               "parallel block with learned absolute positions)"
    for name, want in (("position", "learned"), ("norm", "layernorm"), ("mlp", "gelu")):
        value = field(cfg, name, want)
        if value != want:
            return f"model.{name}={value}: GPT-2 has {want}"
    if field(cfg, "n_kv_head") not in (None, cfg.n_head):
        return f"model.n_kv_head={cfg.n_kv_head}: GPT-2 has no grouped-query attention"
    if not cfg.bias:
        return "model.bias=false: GPT-2's linears and LayerNorms always have biases"
    if not full_attention(cfg):
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


# transformers' GPT2Config defaults of the keys read below (tests compare them)
_GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
    "pad_token_id": None,
}


def _gpt2_model_config(hf: HFConfig) -> dict[str, Any]:
    if hf["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
        raise hf.refuse("activation_function", "megatrain's GeLU is the tanh approximation")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf[flag]:
            raise hf.refuse(flag, "megatrain's attention does not do that")
    if not hf["scale_attn_weights"]:
        raise hf.refuse("scale_attn_weights", "megatrain scales attention by 1/sqrt(head_dim)")
    # megatrain's one dropout sits after the embedding, where GPT-2's embd_pdrop does; it has none
    # on attention probabilities or on the residual branches. Dropout is training noise, not the
    # model's function (in evaluation the two compute the same), and GPT-2's own config.json
    # carries 0.1 there: imported, saying what continued training leaves out.
    inside = {key: hf[key] for key in ("attn_pdrop", "resid_pdrop") if hf[key]}
    if inside:
        log.warning("config.json %s: megatrain trains without dropout inside the blocks (only model.dropout "
                    "after the embeddings); the imported model computes the same in evaluation",
                    ", ".join(f"{key}={value}" for key, value in inside.items()))
    return {
        "vocab_size": hf["vocab_size"], "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": hf["n_embd"],
        "d_ff": hf["n_inner"] or 4 * hf["n_embd"], "seq_len": hf["n_positions"], "block": "serial",
        "position": "learned", "norm": "layernorm", "mlp": "gelu", "n_kv_head": None, "attention": "full",
        "window": None, "bias": True, "tie_embeddings": bool(hf["tie_word_embeddings"]),
        "norm_eps": hf["layer_norm_epsilon"], "dropout": float(hf["embd_pdrop"]), "rope_scaling": None,
    }


_SUMMARY = "GPT2DoubleHeadsModel's classification head, which a causal LM does not have"

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
        Rename("blocks.{i}.attn.qkv.weight", "transformer.h.{i}.attn.c_attn.weight", "transpose"),
        Rename("blocks.{i}.attn.qkv.bias", "transformer.h.{i}.attn.c_attn.bias"),
        Rename("blocks.{i}.attn.proj.weight", "transformer.h.{i}.attn.c_proj.weight", "transpose"),
        Rename("blocks.{i}.attn.proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
        Rename("blocks.{i}.ln2.weight", "transformer.h.{i}.ln_2.weight"),
        Rename("blocks.{i}.ln2.bias", "transformer.h.{i}.ln_2.bias"),
        Rename("blocks.{i}.mlp.fc.weight", "transformer.h.{i}.mlp.c_fc.weight", "transpose"),
        Rename("blocks.{i}.mlp.fc.bias", "transformer.h.{i}.mlp.c_fc.bias"),
        Rename("blocks.{i}.mlp.proj.weight", "transformer.h.{i}.mlp.c_proj.weight", "transpose"),
        Rename("blocks.{i}.mlp.proj.bias", "transformer.h.{i}.mlp.c_proj.bias"),
    ),
    refusal=_gpt2_refusal, hf_config=_gpt2_config, model_config=_gpt2_model_config, defaults=_GPT2_DEFAULTS,
    base_prefix="transformer.",
    neutral={**{f"summary_{k}": _SUMMARY for k in ("type", "use_proj", "activation", "proj_to_labels", "first_dropout")},
             "n_ctx": "the context length of transformers 2 (n_positions is the one transformers reads)"},
    ignored_tensors={r"\.attn\.(bias|masked_bias)$": "the causal-mask buffers older transformers saved and rebuilds"},
)
