"""RoPE as a transformers config.json spells it -> megatrain's ``rope_theta`` and ``rope_scaling``.

transformers reads rotary settings in several spellings, all found in published model folders:

- ``rope_parameters`` (transformers 5): ``{"rope_type": ..., "rope_theta": ..., <the type's keys>}``;
- ``rope_scaling`` (older): the same dict with the type under ``type`` or ``rope_type``, and the
  base as the top-level ``rope_theta`` (GPT-NeoX: ``rotary_emb_base``, ``rotary_pct``);
- neither: plain RoPE with the top-level base, or transformers' default 10000.

Precedence is transformers' (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): a
non-empty ``rope_scaling`` replaces ``rope_parameters``; inside the dict ``rope_type`` beats
``type`` and ``rope_theta`` beats the top-level base; a top-level ``original_max_position_embeddings``
beats the dict's (Phi-3's exception), which defaults to ``max_position_embeddings``. Where two
spellings say different things this module refuses rather than pick one silently.

Types megatrain computes exactly: ``default``; ``yarn`` (megatrain's ``rope_scaling`` with
``rope_type: yarn``: factor, original_max_position, beta_fast / beta_slow (transformers' ``or``
defaults 32 / 1), attention_factor or mscale / mscale_all_dim, truncate); ``llama3`` (megatrain's ``rope_scaling``, the
same formula as transformers' ``_compute_llama3_parameters``); ``linear`` (every frequency
divided by ``factor``), which is Llama 3's rule with every band below its low-frequency cut:
``original_max_position`` 1 puts the cut at a wavelength of 1, and the shortest RoPE wavelength is
2 pi, so each inverse frequency is divided by ``factor``, the same single division transformers
does. Everything else (``longrope`` scales attention as well, ``dynamic`` changes the
base with the sequence length at run time, ``proportional``, per-layer RoPE, a partial rotary
dimension) is refused naming the field and its value: importing it as plain RoPE would train a
different model than the one published.
"""

from __future__ import annotations

from typing import Any

from megatrain.interop.mapping import HFConfig

DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta

# The keys each computed type may hold (transformers' _validate_<type>_rope_parameters); any
# other key in the dict is refused, naming it, rather than dropped.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": _COMMON,
    "linear": _COMMON | {"factor"},
    "llama3": _COMMON | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": _COMMON | {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"},
}
# Linear scaling as Llama 3's rule (see the module docstring): every wavelength lies above the cut.
_ALL_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 2.0, "original_max_position": 1}


def rope_fields(hf: HFConfig, types: tuple[str, ...] = ("default", "llama3", "linear", "yarn"), theta_key: str = "rope_theta",
                partial_key: str = "partial_rotary_factor", partial_default: float = 1.0) -> dict[str, Any]:
    """``{"rope_theta": ..., "rope_scaling": None | {...}}`` for ModelConfig, or ImportMismatch
    naming the config.json field megatrain cannot compute. ``theta_key``, ``partial_key`` and
    ``partial_default``: the architecture's top-level spellings (GPT-NeoX: rotary_emb_base,
    rotary_pct, 0.25)."""
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    if scaling and parameters and scaling != parameters:
        raise hf.refuse("rope_scaling", f"differs from rope_parameters={parameters!r}: transformers reads "
                        "rope_scaling and drops rope_parameters; say one of them")
    key = "rope_scaling" if scaling else "rope_parameters"
    params = scaling or parameters or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise hf.refuse(key, "megatrain has one RoPE for every layer (a dict of rope_type, rope_theta, ...)")

    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise hf.refuse(f"{key}.type", f"differs from {key}.rope_type={params['rope_type']!r}", params["type"])
    if rope_type not in types:
        why = {"longrope": "LongRoPE also scales the attention logits",
               "dynamic": "dynamic NTK changes the base with the sequence length at run time"}.get(rope_type, "")
        computed = ", ".join(types)
        raise hf.refuse(f"{key}.{type_key}", f"megatrain computes RoPE {computed} exactly{'; ' + why if why else ''} "
                        "(importing it as plain RoPE would train another model)", rope_type)
    unknown = sorted(set(params) - _KEYS[rope_type])
    if unknown:
        raise hf.refuse(f"{key}.{unknown[0]}", f"not a {rope_type} RoPE parameter megatrain maps", params[unknown[0]])

    top_theta = hf.get(theta_key)
    theta = params.get("rope_theta", top_theta if top_theta is not None else DEFAULT_THETA)
    if top_theta is not None and top_theta != theta:
        raise hf.refuse(theta_key, f"differs from {key}.rope_theta={theta!r}, which transformers uses")
    top_partial = hf.get(partial_key)
    partial = params.get("partial_rotary_factor", top_partial if top_partial is not None else partial_default)
    if partial != 1.0:
        where = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in params else partial_key
        raise hf.refuse(where, "megatrain rotates every dimension of a head (partial_rotary_factor 1.0)", partial)

    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if rope_type == "yarn":
        return {"rope_theta": float(theta), "rope_scaling": _yarn(hf, key, params)}
    if "factor" not in params:
        raise hf.refuse(key, f"{rope_type} RoPE without a factor")
    if rope_type == "linear":
        return {"rope_theta": float(theta), "rope_scaling": {"factor": float(params["factor"]), **_ALL_BANDS}}
    for needed in ("low_freq_factor", "high_freq_factor"):
        if needed not in params:
            raise hf.refuse(key, f"llama3 RoPE without {needed}")
    original = hf.get("original_max_position_embeddings")  # read top-level first: it wins in transformers
    if original is None:
        original = params.get("original_max_position_embeddings", hf["max_position_embeddings"])
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise hf.refuse(f"{key}.high_freq_factor", f"must exceed low_freq_factor={params['low_freq_factor']}",
                        params["high_freq_factor"])
    return {"rope_theta": float(theta), "rope_scaling": {
        "factor": float(params["factor"]), "low_freq_factor": float(params["low_freq_factor"]),
        "high_freq_factor": float(params["high_freq_factor"]), "original_max_position": int(original)}}


def _yarn(hf: HFConfig, key: str, params: dict[str, Any]) -> dict[str, Any]:
    """megatrain's YaRN fields as transformers' ``_compute_yarn_parameters`` reads the dict: the
    original context top-level first, else the dict's, else max_position_embeddings; a missing
    factor is max_position_embeddings / original; beta_fast and beta_slow fall back (``or``) to 32 and 1."""
    original = hf.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", hf["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    out = {"rope_type": "yarn", "factor": float(factor), "original_max_position": int(original),
           "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
           "truncate": bool(params.get("truncate", True))}
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(name) is not None:
            out[name] = float(params[name])
    if out["beta_fast"] < out["beta_slow"]:
        raise hf.refuse(f"{key}.beta_fast", f"must be >= beta_slow={out['beta_slow']}", out["beta_fast"])
    return out
