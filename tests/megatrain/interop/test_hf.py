"""Hugging Face export and import: exact both ways (logits within 1e-4 in fp32), or refused."""

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain.config import ModelConfig
from megatrain.interop.hf import (
    FAMILIES,
    ExportRefused,
    ImportMismatch,
    export_model,
    family_for,
    load_hf_weights,
    model_config_from_hf,
)
from megatrain.model import GPT

V, T = 320, 32
SERIAL_GPT = {"vocab_size": V, "n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": T, "block": "serial",
              "attention": "full"}
LLAMA = dict(SERIAL_GPT, position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False,
             tie_embeddings=False, d_ff=96)


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    return tokenizer.to_str().encode()


def random_model(**fields) -> GPT:
    """A GPT whose every tensor (biases and norm gains too) is random, so no mapping error hides."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 and p.shape[0] == model.cfg.d_model else 0.0))
    return model.eval()


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(1))


EXPORTABLE = {
    "gpt2 tied": dict(SERIAL_GPT),
    "gpt2 untied": dict(SERIAL_GPT, tie_embeddings=False),
    "gpt2 window = seq_len": dict(SERIAL_GPT, attention="sliding", window=T),
    "llama GQA untied": dict(LLAMA),
    "llama MHA tied, biases, llama3 rope scaling": dict(
        LLAMA, n_kv_head=None, bias=True, tie_embeddings=True, rope_theta=5e5,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 16}),
    "mistral sliding window, multi-query": dict(LLAMA, n_kv_head=1, attention="sliding", window=8),
    "neox serial": dict(SERIAL_GPT, position="rope", bias=True),
    "neox parallel block": dict(SERIAL_GPT, position="rope", block="parallel", tie_embeddings=False),
}


@pytest.mark.parametrize("name", EXPORTABLE)
def test_export_then_from_pretrained_gives_the_same_logits(name, tmp_path, tokenizer_json):
    model = random_model(**EXPORTABLE[name])
    out = export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    for file in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / file).is_file(), file
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == family_for(model.cfg).architecture
    # every tensor the architecture has, and nothing it would silently ignore
    expected = set(hf.state_dict()) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set())
    with safe_open(out / "model.safetensors", "pt") as written:
        assert set(written.keys()) == expected
    idx = tokens()
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # and back: a recipe derived from the folder, weights imported, the same logits again
    back = GPT(ModelConfig(**{**model_config_from_hf(out), "attention": model.cfg.attention, "window": model.cfg.window}))
    load_hf_weights(back, out)
    with torch.no_grad():
        assert torch.equal(back.eval()(idx), ours) or (back(idx) - ours).abs().max().item() < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("def add(a, b):")["input_ids"]) == "def add(a, b):"
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == tokenizer.eos_token_id


REFUSED = {  # the field the message must name
    "model.block": dict(SERIAL_GPT, block="parallel"),  # MegaScale's default: parallel + learned positions
    "model.attention": dict(SERIAL_GPT, attention="sliding", window=8),
    "model.bias": dict(SERIAL_GPT, bias=False),
    "model.block=parallel": dict(LLAMA, block="parallel"),  # Llama parts in a parallel block
    "model.bias=true": dict(LLAMA, bias=True, attention="sliding", window=8),  # Mistral has no biases
    "model.n_kv_head": dict(SERIAL_GPT, position="rope", n_kv_head=2),  # NeoX has no GQA
}


@pytest.mark.parametrize("field", REFUSED)
def test_an_inexact_export_is_refused_naming_the_field(field, tmp_path, tokenizer_json):
    model = random_model(**REFUSED[field])
    with pytest.raises(ExportRefused, match=field.replace(".", r"\.")):
        export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    assert not (tmp_path / "hf").exists()  # nothing half-written


def imported_matches(hf: torch.nn.Module, folder) -> dict:
    """Save a (perturbed) transformers model, import it into the GPT its config describes, and
    check the logits; returns the ModelConfig fields derived from the folder."""
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.eval().save_pretrained(folder)
    fields = model_config_from_hf(folder)
    model = GPT(ModelConfig(**fields))
    load_hf_weights(model, folder)
    idx = tokens()
    with torch.no_grad():
        assert (model.eval()(idx) - hf(idx).logits).abs().max().item() < 1e-4
    return fields


def test_import_of_a_locally_built_gpt2_gives_its_logits(tmp_path):
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    fields = imported_matches(hf, tmp_path / "gpt2")
    assert fields["block"] == "serial" and fields["seq_len"] == 64
    # a recipe that is not this model is refused with the field named
    with pytest.raises(ImportMismatch, match="model.n_layer"):
        load_hf_weights(GPT(ModelConfig(**{**fields, "n_layer": 1})), tmp_path / "gpt2")


def test_import_of_a_locally_built_llama_gives_its_logits(tmp_path):
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    fields = imported_matches(hf, tmp_path / "llama")
    assert (fields["position"], fields["norm"], fields["mlp"], fields["n_kv_head"]) == ("rope", "rmsnorm", "swiglu", 2)
    with pytest.raises(ImportMismatch, match="model.n_kv_head"):
        load_hf_weights(GPT(ModelConfig(**{**fields, "n_kv_head": 4})), tmp_path / "llama")


def test_every_family_maps_every_tensor_of_its_model_exactly_once(tokenizer_json):
    for family in FAMILIES:
        for fields in [f for f in EXPORTABLE.values() if family_for(ModelConfig(**f)) is family]:
            model = random_model(**fields)
            state = model.state_dict()
            theirs = family.to_hf(state, model.cfg)
            assert sum(t.numel() for t in theirs.values()) >= sum(t.numel() for t in state.values())
            back = family.from_hf(theirs, model.cfg)
            assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
