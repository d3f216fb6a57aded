"""Mixture-of-experts Hugging Face export and import (megatrain/interop/moe.py, moe_config.py): a tiny
MoE's logits equal transformers' own class both ways (fp32, max |diff| < 1e-5), or the config
field no class computes is named in one line."""

import pytest
import torch
import transformers
import yaml

from megatrain.config import ModelConfig
from megatrain.interop.hf import (
    ExportRefused,
    ImportMismatch,
    export_model,
    family_for,
    import_cli,
    load_hf_weights,
    model_config_from_hf,
)
from megatrain.model import GPT
from tests.megatrain.interop.test_hf import tokenizer_json  # noqa: F401 (a module fixture)

V, T = 320, 32
MOE = {"vocab_size": V, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "seq_len": T, "block": "serial",
       "attention": "full", "position": "rope", "norm": "rmsnorm", "mlp": "moe", "bias": False,
       "tie_embeddings": False, "d_ff": 96}
TOLERANCE = 1e-5  # fp32; measured: 0 (Mixtral), 6e-7 (Qwen2-MoE, GLM-4-MoE)


def random_moe(**fields) -> GPT:
    """An MoE whose every tensor is random (norm gains around 1, the aux-free bias too), so no mapping error hides."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MOE, **fields}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
        if model.cfg.moe.load_balance == "aux_free":
            for name, buffer in model.named_buffers():
                if name.endswith("router.bias"):
                    buffer.copy_(torch.randn_like(buffer) * 0.1)  # it changes which experts are chosen
    return model.eval()


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(1))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


EXPORTABLE = {  # name -> (model.moe, other model fields, the class)
    "Mixtral: softmax top-2, renormalised": ({"n_experts": 8, "top_k": 2, "expert_d_ff": 48}, {}, "MixtralForCausalLM"),
    "Mixtral with a sliding window": ({"n_experts": 4, "top_k": 2}, {"attention": "sliding", "window": 8},
                                      "MixtralForCausalLM"),
    "Qwen2-MoE: OLMoE-like unnormalised top-2, every 2nd layer routed": (
        {"n_experts": 8, "top_k": 2, "norm_topk_prob": False, "expert_d_ff": 48, "moe_every": 2}, {},
        "Qwen2MoeForCausalLM"),
    "GLM-4-MoE: sigmoid, aux-free bias, a shared expert, a dense first layer": (
        {"n_experts": 8, "top_k": 2, "router_score": "sigmoid", "load_balance": "aux_free", "n_shared_experts": 1,
         "expert_d_ff": 48, "dense_layers": 1}, {}, "Glm4MoeForCausalLM"),
}


@pytest.mark.parametrize("name", EXPORTABLE)
def test_export_then_from_pretrained_gives_the_same_logits(name, tmp_path, tokenizer_json):  # noqa: F811
    moe, fields, architecture = EXPORTABLE[name]
    model = random_moe(moe=moe, **fields)
    out = export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == family_for(model.cfg).architecture == architecture
    # every tensor of the class written, nothing it ignores: transformers initialised nothing itself
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    idx = tokens()
    with torch.no_grad():
        ours = model(idx)
        assert max_diff(ours, hf.eval()(idx).logits) < TOLERANCE
    # and back: the recipe the folder describes, its weights loaded, the same logits
    back = GPT(ModelConfig(**{**model_config_from_hf(out), "attention": model.cfg.attention,
                              "window": model.cfg.window}))
    assert back.cfg.moe.model_dump(include={"n_experts", "top_k", "router_score", "norm_topk_prob", "n_shared_experts"}) \
        == model.cfg.moe.model_dump(include={"n_experts", "top_k", "router_score", "norm_topk_prob", "n_shared_experts"})
    load_hf_weights(back, out)
    with torch.no_grad():
        assert max_diff(back.eval()(idx), ours) < TOLERANCE


def test_megatrain_import_keeps_the_base_recipes_load_balancing(tmp_path, tokenizer_json):  # noqa: F811
    """The router's balance knobs train, they compute nothing: the base recipe's stay; the architecture is the folder's."""
    model = random_moe(moe={"n_experts": 4, "top_k": 2, "expert_d_ff": 48})
    export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"mlp": "moe", "moe": {"n_experts": 16, "z_loss_coef": 0.001,
                                                                     "aux_loss_coef": 0.02}}}))
    assert import_cli(["--hf", str(tmp_path / "hf"), "--config", str(base), "--out", str(tmp_path / "r.yaml")]) == 0
    moe = yaml.safe_load((tmp_path / "r.yaml").read_text())["model"]["moe"]
    assert (moe["n_experts"], moe["z_loss_coef"], moe["aux_loss_coef"]) == (4, 0.001, 0.02)


def test_each_family_maps_every_tensor_both_ways_exactly():
    for moe, fields, _ in EXPORTABLE.values():
        model = random_moe(moe=moe, **fields)
        state, family = model.state_dict(), family_for(model.cfg)
        back = family.from_hf(family.to_hf(state, model.cfg), model.cfg)
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


REFUSED = {  # model fields -> what each class's reason names
    "softmax with a shared expert (moe-tiny-cpu)": (
        {"moe": {"n_shared_experts": 1, "expert_d_ff": 48}},
        ("MixtralForCausalLM: model.moe.n_shared_experts=1", "Qwen2MoeForCausalLM: model.moe.n_shared_experts=1",
         "Glm4MoeForCausalLM: model.moe.router_score=softmax")),
    "sigmoid, every 2nd layer routed": (
        {"moe": {"router_score": "sigmoid", "moe_every": 2}},
        ("MixtralForCausalLM: model.moe.router_score=sigmoid", "Glm4MoeForCausalLM: model.moe.moe_every=2")),
    "softmax with the aux-free bias": (
        {"moe": {"load_balance": "aux_free", "norm_topk_prob": False}},
        ("Qwen2MoeForCausalLM: model.moe.load_balance=aux_free",)),
    "biases": ({"bias": True, "moe": {}}, ("MixtralForCausalLM: model.bias=true",)),
    "a parallel block": ({"block": "parallel", "moe": {}}, ("MixtralForCausalLM: model.block=parallel",)),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_moe_no_class_computes_is_refused_naming_the_field(name, tmp_path, tokenizer_json):  # noqa: F811
    fields, named = REFUSED[name]
    model = random_moe(**fields)
    with pytest.raises(ExportRefused) as refused:
        export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    message = str(refused.value)
    assert "\n" not in message and all(n in message for n in named), message
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_a_non_zero_router_bias_is_refused_where_the_class_has_none(tmp_path, tokenizer_json):  # noqa: F811
    model = random_moe(moe={"n_experts": 4, "top_k": 2})
    with torch.no_grad():
        model.blocks[1].mlp.router.bias[2] = 0.5  # e.g. trained aux_free, then switched to aux_loss
    with pytest.raises(ExportRefused, match=r"blocks\.1\.mlp\.router\.bias is not zero"):
        export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)


# ------------------------------------------------------------------------------------ import

SMALL = {"vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_experts_per_tok": 2}
MADE = {  # a transformers class with random weights -> what megatrain must make of it
    "mixtral": (transformers.MixtralConfig, {"intermediate_size": 48, "num_local_experts": 4}, "MixtralForCausalLM"),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {
        "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8, "norm_topk_prob": False,
        "shared_expert_intermediate_size": 0, "qkv_bias": False, "mlp_only_layers": [0]}, "Qwen2MoeForCausalLM"),
    "glm4_moe": (transformers.Glm4MoeConfig, {
        "intermediate_size": 96, "moe_intermediate_size": 48, "n_routed_experts": 8, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 1.0}}, "Glm4MoeForCausalLM"),
}


@pytest.mark.parametrize("name", MADE)
def test_import_of_a_transformers_made_moe_gives_its_logits(name, tmp_path):
    config_class, changes, architecture = MADE[name]
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config_class(**{**SMALL, **changes}), dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for buffer_name, buffer in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    hf.eval().save_pretrained(tmp_path / name)
    assert type(hf).__name__ == architecture
    fields = model_config_from_hf(tmp_path / name)
    model = GPT(ModelConfig(**fields))
    load_hf_weights(model, tmp_path / name)
    idx = tokens()
    with torch.no_grad():
        assert max_diff(model.eval()(idx), hf(idx).logits) < TOLERANCE
    # a recipe that is not this model is refused naming the field
    other = {**fields, "moe": {**fields["moe"], "top_k": 1}}
    with pytest.raises(ImportMismatch, match=r"model\.moe\.top_k: recipe 1"):
        load_hf_weights(GPT(ModelConfig(**other)), tmp_path / name)


KEYS = {  # config class, the keys, what the one-line refusal names (None: imports)
    "qwen2: q/k/v biases": (transformers.Qwen2MoeConfig, {"qkv_bias": True}, "qkv_bias=True"),
    "qwen2: a gated shared expert": (transformers.Qwen2MoeConfig, {"qkv_bias": False}, "shared_expert_intermediate_size=5632"),
    "qwen2: a dense layer after a routed one": (
        transformers.Qwen2MoeConfig, {"qkv_bias": False, "shared_expert_intermediate_size": 0, "mlp_only_layers": [1]},
        "mlp_only_layers=[1]"),
    "qwen2: sliding windows in some layers": (
        transformers.Qwen2MoeConfig, {"qkv_bias": False, "shared_expert_intermediate_size": 0,
                                      "use_sliding_window": True}, "layer_types="),
    "qwen2: a step of 2 and the first layer dense": (
        transformers.Qwen2MoeConfig, {"qkv_bias": False, "shared_expert_intermediate_size": 0, "decoder_sparse_step": 2,
                                      "mlp_only_layers": [0]}, None),
    "glm4: transformers' half-rotated default": (transformers.Glm4MoeConfig, {"rope_parameters": None},
                                                 "partial_rotary_factor=0.5"),
    "glm4: q/k norm": (transformers.Glm4MoeConfig, {"use_qk_norm": True}, "use_qk_norm=True"),
    "glm4: scaled weights": (transformers.Glm4MoeConfig, {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    "glm4: group-limited routing": (transformers.Glm4MoeConfig, {"n_group": 2, "topk_group": 1, "n_routed_experts": 8},
                                    "topk_group=1"),
    "mixtral: another activation": (transformers.MixtralConfig, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "mixtral: training knobs only": (transformers.MixtralConfig, {"router_jitter_noise": 0.1, "router_aux_loss_coef": 0.02,
                                                                  "output_router_logits": True}, None),
}
_GLM_FULL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


@pytest.mark.parametrize("name", KEYS)
def test_every_moe_key_is_mapped_or_refused_by_name(name, tmp_path):
    config_class, keys, refused = KEYS[name]
    base = {**SMALL, "rope_parameters": _GLM_FULL_ROPE} if config_class is transformers.Glm4MoeConfig else SMALL
    config_class(**{**base, **keys}).save_pretrained(tmp_path)
    if refused is None:
        ModelConfig(**model_config_from_hf(tmp_path))
        return
    with pytest.raises(ImportMismatch) as error:
        model_config_from_hf(tmp_path)
    message = str(error.value)
    assert refused in message and str(tmp_path / "config.json") in message and "\n" not in message, message


def test_an_unknown_key_of_a_moe_config_is_refused(tmp_path):
    transformers.MixtralConfig(**SMALL, my_router_knob=1).save_pretrained(tmp_path)
    with pytest.raises(ImportMismatch, match="my_router_knob=1"):
        model_config_from_hf(tmp_path)


@pytest.mark.parametrize("config_class", [transformers.Qwen3MoeConfig, transformers.OlmoeConfig])
def test_a_moe_class_with_q_k_norm_is_refused_saying_so(config_class, tmp_path):
    config_class(**{k: v for k, v in SMALL.items() if k != "rope_parameters"}).save_pretrained(tmp_path)
    with pytest.raises(ImportMismatch, match="RMSNorm on q and k"):
        model_config_from_hf(tmp_path)
