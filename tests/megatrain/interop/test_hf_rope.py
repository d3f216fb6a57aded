"""Every RoPE spelling transformers reads from a config.json is imported exactly (megatrain's
logits equal transformers' for the same folder, fp32, within 1e-4, at a length where the scaling
changes them) or refused naming the field and its value: never silently as plain RoPE."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatrain.config import ModelConfig
from megatrain.interop.hf import ImportMismatch, load_hf_weights, model_config_from_hf
from megatrain.model import GPT
from tests.megatrain.interop.hf_folders import (
    VOCAB,
    copy_folder,
    edit_config,
    save_llama,
)

T = 128  # positions compared: eight times the original context below, so every scaling shows
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
NO_ROPE = ("rope_parameters", "rope_theta", "rope_scaling")

# name: (config.json keys replacing every RoPE key, whether megatrain scales the frequencies)
EXACT = {
    "no RoPE key (transformers' base 10000)": ({}, False),
    "top-level rope_theta": ({"rope_theta": 5e5}, False),
    "rope_parameters default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, False),
    "rope_parameters llama3": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}, True),
    "rope_scaling type=llama3 + rope_theta": ({"rope_scaling": {"type": "llama3", **LLAMA3}, "rope_theta": 5e5}, True),
    "rope_scaling rope_type=llama3 factor 32 (Llama 3.2's spelling)": (
        {"rope_scaling": {"rope_type": "llama3", **LLAMA3, "factor": 32.0}, "rope_theta": 5e5}, True),
    "llama3 without original_max_position_embeddings (max_position_embeddings)": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
         "max_position_embeddings": 32}, True),
    "a top-level original_max_position_embeddings beats the dict's (Phi-3's)": (
        {"rope_scaling": {"rope_type": "llama3", **LLAMA3}, "original_max_position_embeddings": 8}, True),
    "rope_scaling type=linear": ({"rope_scaling": {"type": "linear", "factor": 4.0}}, True),
    "rope_parameters linear": ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}, True),
    "rope_scaling and rope_parameters both, the same": (
        {"rope_scaling": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3},
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}, True),
}
# name: (config.json keys replacing every RoPE key, what the refusal must name)
REFUSED = {
    "yarn beta_fast below beta_slow": ({"rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 1.0,
                                                         "beta_slow": 2.0}}, "rope_scaling.beta_fast=1.0"),
    "a key yarn does not have": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                      "low_freq_factor": 1.0}}, "rope_parameters.low_freq_factor=1.0"),
    "rope_scaling dynamic": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    "rope_scaling longrope": ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                "long_factor": [2.0] * 8}}, "rope_scaling.rope_type='longrope'"),
    "a type transformers does not know": ({"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, "ntk-by-parts"),
    "a partial rotary dimension": ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                        "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    "a key llama3 does not have": ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "attention_factor": 2.0}},
                                   "rope_scaling.attention_factor=2.0"),
    "llama3 without its factors": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    "rope_scaling and rope_parameters disagree": (
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_parameters": {"rope_type": "default"}}, "rope_scaling="),
    "rope_theta beside a different rope_parameters.rope_theta": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4}, "rope_theta=10000.0"),
    "type and rope_type disagree": ({"rope_scaling": {"type": "linear", "rope_type": "llama3", **LLAMA3}},
                                    "rope_scaling.type='linear'"),
    "RoPE per layer type": ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters="),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rope") / "llama"
    save_llama(folder, tokenizer=False, max_position_embeddings=T)
    return folder


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


def imported(folder) -> GPT:
    model = GPT(ModelConfig(**model_config_from_hf(folder)))
    load_hf_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize("name", EXACT)
def test_a_spelling_megatrain_computes_gives_transformers_logits(name, base, tmp_path):
    keys, scaled = EXACT[name]
    folder = copy_folder(base, tmp_path / "llama")
    edit_config(folder, drop=NO_ROPE, **keys)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = imported(folder)
    idx = tokens()
    with torch.no_grad():
        reference = theirs(idx).logits
        diff = (ours(idx) - reference).abs().max().item()
        print(f"\n{name}: max |logit diff| {diff:.2e}")
        assert diff < 1e-4
        assert (ours.cfg.rope_scaling is not None) == scaled
        if scaled:  # the scaling matters at this length: plain RoPE would be far off
            plain = GPT(ModelConfig(**{**model_config_from_hf(folder), "rope_scaling": None}))
            plain.load_state_dict(ours.state_dict())
            assert (plain.eval()(idx) - reference).abs().max().item() > 1e-2


@pytest.mark.parametrize("name", REFUSED)
def test_a_spelling_megatrain_cannot_compute_is_refused_by_name(name, base, tmp_path):
    keys, named = REFUSED[name]
    folder = copy_folder(base, tmp_path / "llama")
    edit_config(folder, drop=NO_ROPE, **keys)
    with pytest.raises(ImportMismatch) as refused:
        model_config_from_hf(folder)
    message = str(refused.value)
    assert named in message and "config.json" in message and "\n" not in message, message
