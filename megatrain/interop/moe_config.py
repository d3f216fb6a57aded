"""config.json of the mixture-of-experts families (``moe.py``) both ways, and what each refuses.

Which transformers class computes which megatrain MoE (``model.mlp: moe``, ``megatrain/model/moe.py``):

- ``MixtralForCausalLM``: softmax over all experts, top-k, the k scores renormalised (always:
  ``norm_topk_prob`` true), every layer routed, no shared expert; a sliding window for every layer.
- ``Qwen2MoeForCausalLM``: the same router with ``norm_topk_prob`` either way, routed layers by
  ``decoder_sparse_step`` (megatrain's ``moe_every``: (i + 1) % step == 0) less ``mlp_only_layers``
  (megatrain's first ``dense_layers``), dense layers of ``intermediate_size``, experts of
  ``moe_intermediate_size``. Its shared expert is scaled by sigmoid(shared_expert_gate(x)), which
  megatrain's ungated shared experts are not: megatrain exports ``shared_expert_intermediate_size``
  0 (a zero-width shared expert adds exactly 0) and refuses shared experts.
- ``Glm4MoeForCausalLM``: DeepSeek-V3's router on plain GQA attention: sigmoid scores, the
  aux-free bias (``e_score_correction_bias``) added for the choice only, ``norm_topk_prob``, shared
  experts added ungated (width ``n_shared_experts * moe_intermediate_size``), the first
  ``first_k_dense_replace`` layers dense. Exact with one expert group (``n_group`` 1, or every
  group kept), ``routed_scaling_factor`` 1, no q/k norm, RoPE on the whole head
  (``partial_rotary_factor`` 1; transformers' default for this class is 0.5).

Qwen3-MoE and OLMoE put an RMSNorm on q and k in every layer, which megatrain's attention does not
have; DeepSeek-V2/V3 use latent attention (MLA). None of them computes a megatrain model.

What no class computes is refused naming the field: a softmax router with shared experts (as in
``moe-tiny-cpu``), a sigmoid router with ``moe_every`` > 1, biases. The load-balancing losses are
training knobs, not logits: megatrain's per-layer aux loss and z-loss have no exact transformers
counterpart (transformers' aux loss pools every layer's tokens), so ``router_aux_loss_coef`` and
``output_router_logits`` are written for information and read as neutral; an imported recipe
trains with the base recipe's balance knobs (``hf_import.MOE_TRAINING_KNOBS``), else megatrain's
defaults (aux loss 0.01), or ``aux_free`` for GLM-4-MoE, whose bias is routing state and is imported.
"""

from __future__ import annotations

from typing import Any

from megatrain.config import ModelConfig
from megatrain.interop.llama import _rope_parameters, llama_block_fields
from megatrain.interop.mapping import HFConfig, field, full_attention, kv_heads

MIXTRAL, QWEN2_MOE, GLM4_MOE = "Mixtral", "Qwen2-MoE", "GLM-4-MoE"
_LOSS = ("transformers' load-balancing loss while training (pooled over all layers; only with output_router_logits): "
         "not megatrain's per-layer loss, and no part of the logits; the recipe's model.moe.aux_loss_coef trains")
MOE_NEUTRAL = {"router_aux_loss_coef": _LOSS, "output_router_logits": _LOSS}
# MoE classes whose attention megatrain does not compute: model_type -> why (the import refusal says it)
NOT_COMPUTED = {
    "qwen3_moe": "Qwen3-MoE puts an RMSNorm on q and k in every layer, which megatrain's attention does not have",
    "olmoe": "OLMoE puts an RMSNorm on q and k in every layer, which megatrain's attention does not have",
    "deepseek_v3": "DeepSeek-V3's attention is multi-head latent attention (MLA), which megatrain does not compute",
    "deepseek_v2": "DeepSeek-V2's attention is multi-head latent attention (MLA), which megatrain does not compute",
}


# ------------------------------------------------------------------------------------ export


def moe_refusal(cfg: ModelConfig, name: str) -> str | None:
    """The first field of ``cfg`` that the MoE class ``name`` cannot compute, as "model.<field>=<value>: why"."""
    m = cfg.moe
    if cfg.mlp != "moe":
        return f"model.mlp={cfg.mlp}: {name} is a mixture of experts (model.mlp=moe)"
    if cfg.block != "serial":
        return f"model.block={cfg.block}: {name} is a serial pre-norm block"
    for knob, want in (("position", "rope"), ("norm", "rmsnorm")):
        if getattr(cfg, knob) != want:
            return f"model.{knob}={getattr(cfg, knob)}: {name} has {want}"
    if cfg.bias:
        return f"model.bias=true: {name} has no biases on the output projection and the experts"
    if name != MIXTRAL and not full_attention(cfg):
        return f"model.attention=sliding (window {cfg.window} < seq_len {cfg.seq_len}): {name} is exported without one"
    want_score = "sigmoid" if name == GLM4_MOE else "softmax"
    if m.router_score != want_score:
        return f"model.moe.router_score={m.router_score}: {name}'s router scores are a {want_score}"
    if name == MIXTRAL and not m.norm_topk_prob:
        return f"model.moe.norm_topk_prob=false: {name} always renormalises the top-k scores"
    if name != GLM4_MOE and m.n_shared_experts:
        gated = " (Qwen2-MoE's one is scaled by a sigmoid gate)" if name == QWEN2_MOE else ""
        return f"model.moe.n_shared_experts={m.n_shared_experts}: {name} has no ungated shared experts{gated}"
    if name != GLM4_MOE and m.load_balance == "aux_free":
        return f"model.moe.load_balance=aux_free: its bias steers the routing; {name}'s router has none"
    if name != QWEN2_MOE and m.moe_every != 1:
        return f"model.moe.moe_every={m.moe_every}: every {name} layer after the dense ones is routed"
    if name == MIXTRAL and m.dense_layers:
        return f"model.moe.dense_layers={m.dense_layers}: every {name} layer is routed"
    return None


def _attention_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": kv_heads(cfg), "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "rope_parameters": _rope_parameters(cfg), "bos_token_id": eos_id, "eos_token_id": eos_id,
        "num_experts_per_tok": cfg.moe.top_k, "output_router_logits": False,
    }


def _aux_coef(cfg: ModelConfig) -> float:
    """transformers' aux loss of one layer is top_k times megatrain's (it counts each of the k
    choices as a token): this coefficient gives one layer the same gradient."""
    m = cfg.moe
    return m.aux_loss_coef / m.top_k if m.load_balance == "aux_loss" else 0.0


def mixtral_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    return {**_attention_config(cfg, eos_id), "intermediate_size": cfg.expert_ffn_dim,
            "num_local_experts": cfg.moe.n_experts, "router_aux_loss_coef": _aux_coef(cfg), "router_jitter_noise": 0.0,
            "sliding_window": None if full_attention(cfg) else cfg.window}


def qwen2_moe_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    m = cfg.moe
    return {**_attention_config(cfg, eos_id), "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": cfg.expert_ffn_dim,
            "num_experts": m.n_experts, "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": m.moe_every,
            "mlp_only_layers": list(range(m.dense_layers)), "shared_expert_intermediate_size": 0, "qkv_bias": False,
            "use_sliding_window": False, "layer_types": ["full_attention"] * cfg.n_layer,
            "router_aux_loss_coef": _aux_coef(cfg)}


def glm4_moe_config(cfg: ModelConfig, eos_id: int) -> dict[str, Any]:
    m = cfg.moe
    out = _attention_config(cfg, eos_id)
    return {**out, "rope_parameters": {**out["rope_parameters"], "partial_rotary_factor": 1.0},
            "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": cfg.expert_ffn_dim, "n_routed_experts": m.n_experts,
            "n_shared_experts": m.n_shared_experts, "norm_topk_prob": m.norm_topk_prob, "first_k_dense_replace": m.dense_layers,
            "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "attention_bias": False, "use_qk_norm": False,
            "num_nextn_predict_layers": 0}


# transformers' config-class defaults of the keys read below (test_hf_import compares them)
_COMMON_DEFAULTS = {"hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
                    "attention_dropout": 0.0, "rope_parameters": None, "pad_token_id": None, "output_router_logits": False}
MIXTRAL_DEFAULTS = {
    **_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None, "num_experts_per_tok": 2,
    "num_local_experts": 8, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
}
QWEN2_MOE_DEFAULTS = {
    **_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None, "qkv_bias": True,
    "layer_types": None, "bos_token_id": None, "eos_token_id": None,
}
GLM4_MOE_DEFAULTS = {
    **_COMMON_DEFAULTS, "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "attention_bias": False, "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "use_qk_norm": False, "bos_token_id": None, "eos_token_id": None,
}


# ------------------------------------------------------------------------------------ import


def _attention_fields(hf: HFConfig, partial_default: float = 1.0) -> dict[str, Any]:
    """The ModelConfig fields every MoE family shares: a serial RMSNorm/RoPE/GQA block without biases."""
    if hf["hidden_act"] != "silu":
        raise hf.refuse("hidden_act", "megatrain's experts are SwiGLU (silu)")
    return llama_block_fields(hf, mlp="moe", bias=False, partial_default=partial_default)


def mixtral_model_config(hf: HFConfig) -> dict[str, Any]:
    fields = _attention_fields(hf)
    hf.get("router_jitter_noise")  # training-time input noise: neutral for the logits (moe.py's neutral)
    if hf["sliding_window"] is not None:
        fields.update(attention="sliding", window=min(hf["sliding_window"], fields["seq_len"]))
    return {**fields, "d_ff": hf["intermediate_size"],
            "moe": {"n_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"], "router_score": "softmax",
                    "norm_topk_prob": True}}


def _routed_layers(hf: HFConfig, n_layer: int, step: int) -> int:
    """megatrain's dense_layers for Qwen2-MoE's routed layers: (i + 1) % step == 0 and i not in
    mlp_only_layers must be megatrain's i >= dense_layers and (i + 1) % step == 0 for every i."""
    only = hf["mlp_only_layers"] or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise hf.refuse("mlp_only_layers", "not a list of layer indices")
    theirs = [i not in only and (i + 1) % step == 0 for i in range(n_layer)]
    for dense in range(n_layer + 1):
        if theirs == [i >= dense and (i + 1) % step == 0 for i in range(n_layer)]:
            return dense
    raise hf.refuse("mlp_only_layers", "megatrain keeps only the first model.moe.dense_layers layers dense")


def qwen2_moe_model_config(hf: HFConfig) -> dict[str, Any]:
    fields = _attention_fields(hf)
    if hf["qkv_bias"]:
        raise hf.refuse("qkv_bias", "biases on q/k/v only: megatrain has one model.bias for every linear")
    if hf["shared_expert_intermediate_size"]:
        raise hf.refuse("shared_expert_intermediate_size", "Qwen2-MoE scales its shared expert by a sigmoid gate; "
                        "megatrain's shared experts are ungated")
    n_layer = fields["n_layer"]
    use_window = hf["use_sliding_window"]
    layer_types = hf["layer_types"]
    if layer_types is None:  # Qwen2MoeConfig.__post_init__'s rule
        layer_types = ["sliding_attention" if (i + 1) % 2 and i < hf["max_window_layers"] and use_window
                       else "full_attention" for i in range(n_layer)]
    else:
        hf.get("max_window_layers")  # only makes layer_types when they are absent
    if any(t != "full_attention" for t in layer_types):
        raise hf.refuse("layer_types" if hf.get("layer_types") else "use_sliding_window",
                        "sliding windows in some layers: megatrain's window is the same in every layer")
    hf.get("sliding_window")  # read by no full_attention layer
    if hf["num_experts"] <= 0:
        raise hf.refuse("num_experts", "no routed experts: a dense model (import it as Qwen2)")
    step = hf["decoder_sparse_step"]
    if not isinstance(step, int) or step < 1:
        raise hf.refuse("decoder_sparse_step", "not a positive layer step")
    return {**fields, "d_ff": hf["intermediate_size"],
            "moe": {"n_experts": hf["num_experts"], "top_k": hf["num_experts_per_tok"], "router_score": "softmax",
                    "norm_topk_prob": bool(hf["norm_topk_prob"]), "expert_d_ff": hf["moe_intermediate_size"],
                    "moe_every": step, "dense_layers": _routed_layers(hf, n_layer, step)}}


def glm4_moe_model_config(hf: HFConfig) -> dict[str, Any]:
    fields = _attention_fields(hf, partial_default=0.5)  # Glm4MoeConfig's default partial_rotary_factor
    if hf["attention_bias"]:
        raise hf.refuse("attention_bias", "biases on q/k/v only: megatrain has one model.bias for every linear")
    if hf["use_qk_norm"]:
        raise hf.refuse("use_qk_norm", "megatrain's attention has no RMSNorm on q and k")
    if hf["routed_scaling_factor"] != 1.0:
        raise hf.refuse("routed_scaling_factor", "megatrain's combine weights are the (renormalised) scores, unscaled")
    groups, kept = hf["n_group"], hf["topk_group"]
    if groups != 1 and kept != groups:
        raise hf.refuse("topk_group", f"keeps {kept} of n_group={groups} expert groups: megatrain's top-k is over "
                        "every expert")
    return {**fields, "d_ff": hf["intermediate_size"],
            "moe": {"n_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"], "router_score": "sigmoid",
                    "norm_topk_prob": bool(hf["norm_topk_prob"]), "expert_d_ff": hf["moe_intermediate_size"],
                    "n_shared_experts": hf["n_shared_experts"], "dense_layers": hf["first_k_dense_replace"],
                    "load_balance": "aux_free"}}


# ------------------------------------------------------------------------------------ recipe vs folder


def moe_differences(wanted: dict[str, Any], cfg: ModelConfig, hf_dir: str) -> list[str]:
    """The architecture fields of ``model.moe`` where the recipe differs from the folder (the
    balance knobs are the recipe's to choose: they train, they compute nothing)."""
    theirs = ModelConfig(**{**wanted, "seq_len": cfg.seq_len})
    out = []
    if cfg.mlp != "moe":  # named by model.mlp itself
        return []
    for name in ("n_experts", "top_k", "n_shared_experts", "router_score", "norm_topk_prob"):
        ours, want = getattr(cfg.moe, name), getattr(theirs.moe, name)
        if ours != want:
            out.append(f"model.moe.{name}: recipe {ours!r}, {hf_dir} {want!r}")
    if cfg.expert_ffn_dim != theirs.expert_ffn_dim:
        out.append(f"model.moe.expert_d_ff: recipe {cfg.expert_ffn_dim}, {hf_dir} {theirs.expert_ffn_dim}")
    ours_routed = [cfg.is_moe_layer(i) for i in range(cfg.n_layer)]
    if cfg.n_layer == theirs.n_layer and ours_routed != [theirs.is_moe_layer(i) for i in range(theirs.n_layer)]:
        out.append(f"model.moe.dense_layers/moe_every: recipe routes layers "
                   f"{[i for i, r in enumerate(ours_routed) if r]}, {hf_dir} "
                   f"{[i for i in range(theirs.n_layer) if theirs.is_moe_layer(i)]}")
    return out


def dense_width_matters(cfg: ModelConfig) -> bool:
    """Whether model.d_ff computes anything: only in the layers left dense."""
    return field(cfg, "mlp") != "moe" or cfg.n_moe_layers < cfg.n_layer
