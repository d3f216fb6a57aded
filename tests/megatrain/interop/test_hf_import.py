"""``megatrain import`` checks a transformers folder whole before it writes a recipe: every
config.json key mapped or refused by name, every tensor checked by its Hugging Face name and shape
from the safetensors headers (one file or an indexed set of shards)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatrain.config import ModelConfig
from megatrain.interop.hf import (
    FAMILIES,
    ImportMismatch,
    load_hf_weights,
    model_config_from_hf,
    read_model,
)
from megatrain.interop.hf_config import NEUTRAL
from megatrain.interop.hf_tensors import check_tensors
from megatrain.model import GPT
from tests.megatrain.interop.hf_folders import (
    LLAMA,
    VOCAB,
    copy_folder,
    edit_config,
    save_llama,
)

K_PROJ = "model.layers.1.self_attn.k_proj.weight"  # [kv heads 2 * head_dim 16, hidden 64]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("import") / "llama"
    save_llama(folder, tokenizer=False)
    return folder


def refusal(folder) -> str:
    with pytest.raises(ImportMismatch) as refused:
        check_tensors(folder, read_model(folder).family, read_model(folder).model_config())
    message = str(refused.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------- config.json


def test_the_defaults_of_absent_keys_are_transformers_own():
    """A key config.json lacks means transformers' default: each family's table must be it."""
    for family in FAMILIES:
        config_class = transformers.AutoConfig.for_model(family.model_type).__class__
        theirs = {f.name: f.default for f in dataclasses.fields(config_class)}
        for key, value in family.defaults.items():
            assert theirs[key] == value, (family.name, key)


def test_a_mistral_config_without_sliding_window_has_transformers_window(llama, tmp_path):
    folder = copy_folder(llama, tmp_path / "mistral")
    edit_config(folder, drop=("attention_bias", "mlp_bias", "pretraining_tp"), model_type="mistral",
                architectures=["MistralForCausalLM"], max_position_embeddings=8192)
    assert transformers.AutoConfig.from_pretrained(folder).sliding_window == 4096
    fields = model_config_from_hf(folder)
    assert (fields["attention"], fields["window"]) == ("sliding", 4096)
    edit_config(folder, sliding_window=None)  # null: no window
    assert model_config_from_hf(folder)["attention"] == "full"


# what transformers writes at an architecture's defaults: imported, or refused naming the key
SMALL = {"hidden_size": 64, "num_attention_heads": 4}
SAVED = {
    "llama": (transformers.LlamaConfig, SMALL, None),
    "mistral": (transformers.MistralConfig, {**SMALL, "num_key_value_heads": 2}, None),
    "gpt2 (dropout 0.1 inside the blocks: a warning)": (transformers.GPT2Config, {"n_embd": 64, "n_head": 4}, None),
    "gpt2 without dropout": (transformers.GPT2Config, {"n_embd": 64, "n_head": 4, "attn_pdrop": 0, "resid_pdrop": 0},
                             None),
    "gpt_neox (exact GeLU, a quarter rotated)": (transformers.GPTNeoXConfig, SMALL, "hidden_act='gelu'"),
    "gpt_neox, tanh GeLU": (transformers.GPTNeoXConfig, {**SMALL, "hidden_act": "gelu_pytorch_tanh"},
                            "rope_parameters.partial_rotary_factor=0.25"),
}


@pytest.mark.parametrize("name", SAVED)
def test_a_config_transformers_saved_imports_or_names_its_key(name, tmp_path):
    config_class, changes, refused = SAVED[name]
    config_class(**changes).save_pretrained(tmp_path)
    if refused is None:
        ModelConfig(**model_config_from_hf(tmp_path))
    else:
        with pytest.raises(ImportMismatch, match=refused.replace("(", r"\(")):
            model_config_from_hf(tmp_path)


KEYS = {  # a key added to a Llama config.json: None = imports, else what the refusal names
    "an unknown key": ({"my_new_knob": 3}, "my_new_knob=3"),
    "quantization_config": ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config="),
    "custom code": ({"auto_map": {"AutoModelForCausalLM": "modeling.X"}}, "auto_map="),
    "attention dropout": ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "an encoder-decoder": ({"is_encoder_decoder": True}, "is_encoder_decoder=True"),
    "pruned heads": ({"pruned_heads": {"0": [1]}}, "pruned_heads="),
    "another head": ({"architectures": ["LlamaForSequenceClassification"]}, "architectures="),
    "head_dim that is not hidden / heads": ({"head_dim": 32}, "head_dim=32"),
    "biases on attention only": ({"attention_bias": True}, "mlp_bias=False"),
    "another activation": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "a bad eos id": ({"eos_token_id": "x"}, "eos_token_id='x'"),
    "no layers": ({"num_hidden_layers": 0}, "describes no valid megatrain model (model.n_layer: "),
    "every neutral key": ({key: None for key in NEUTRAL}, None),
    "bookkeeping of transformers 4": ({"pretraining_tp": 2, "torch_dtype": "bfloat16", "use_cache": False,
                                       "is_encoder_decoder": False, "pruned_heads": {}, "rope_theta": 500000.0}, None),
}


@pytest.mark.parametrize("name", KEYS)
def test_every_key_is_mapped_or_refused_by_name(name, llama, tmp_path):
    keys, refused = KEYS[name]
    folder = copy_folder(llama, tmp_path / "llama")
    edit_config(folder, **keys)
    if refused is None:
        assert model_config_from_hf(folder)["n_kv_head"] == 2
        return
    with pytest.raises(ImportMismatch) as error:
        model_config_from_hf(folder)
    message = str(error.value)
    assert refused in message and str(folder / "config.json") in message and "\n" not in message, message


def test_a_key_mistral_does_not_have_is_refused(llama, tmp_path):
    """attention_bias is Llama's: a Mistral config.json holding it is not what transformers computes."""
    folder = copy_folder(llama, tmp_path / "mistral")
    edit_config(folder, drop=("pretraining_tp",), model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(ImportMismatch, match="attention_bias=False"):
        model_config_from_hf(folder)


# ---------------------------------------------------------------------------------- tensors


def rewrite(folder, change) -> None:
    """Apply ``change`` to the tensors of ``folder``'s model.safetensors."""
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


TENSORS = {  # a change to the weights: what the refusal names
    "a wrong shape": (lambda t: t.update({K_PROJ: torch.zeros(48, 64)}),
                      f"{K_PROJ} is [48, 64] in model.safetensors, config.json makes it [32, 64]"),
    "a missing tensor": (lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
                         "model.layers.0.mlp.up_proj.weight is missing (config.json makes it [160, 64])"),
    "an unexpected tensor": (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
                             "model.layers.0.self_attn.q_norm.weight is unexpected"),
    "a quantized tensor": (lambda t: t.update({K_PROJ: torch.zeros(32, 64, dtype=torch.int8)}), f"{K_PROJ} has dtype I8"),
    "three problems at once": (lambda t: (t.pop(K_PROJ), t.pop("lm_head.weight"), t.update({"x": torch.ones(1)})),
                               f"lm_head.weight is missing (config.json makes it [384, 64]) (and 2 more: {K_PROJ}, x)"),
}


@pytest.mark.parametrize("name", TENSORS)
def test_each_tensor_is_checked_by_its_hf_name_and_shape(name, llama, tmp_path):
    change, named = TENSORS[name]
    folder = copy_folder(llama, tmp_path / "llama")
    rewrite(folder, change)
    assert named in refusal(folder)


def test_the_run_start_names_the_hf_tensor_too(llama, tmp_path):
    """Loading at training start checks the same way: the Hugging Face name, not megatrain's fused qkv."""
    folder = copy_folder(llama, tmp_path / "llama")
    rewrite(folder, lambda t: t.update({K_PROJ: torch.zeros(48, 64)}))
    with pytest.raises(ImportMismatch, match=f"{K_PROJ} is \\[48, 64\\]"):
        load_hf_weights(GPT(ModelConfig(**{**model_config_from_hf(folder), "seq_len": 64})), folder)


def test_a_truncated_safetensors_file_is_named(llama, tmp_path):
    folder = copy_folder(llama, tmp_path / "llama")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert "model.safetensors: truncated" in refusal(folder)
    (folder / "model.safetensors").write_bytes(data[:4])
    assert "not a safetensors file" in refusal(folder)


def test_what_transformers_drops_on_loading_is_not_a_problem(llama, tmp_path):
    folder = copy_folder(llama, tmp_path / "llama")
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    check_tensors(folder, read_model(folder).family, read_model(folder).model_config())


def logits_match(folder) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = GPT(ModelConfig(**model_config_from_hf(folder)))
    load_hf_weights(model, folder)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.eval()(idx) - hf(idx).logits).abs().max().item() < 1e-4


def test_a_sharded_checkpoint_is_checked_shard_by_shard(tmp_path):
    hf = save_llama(tmp_path / "whole", tokenizer=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    logits_match(tmp_path / "sharded")

    holder = next(s for s in shards if K_PROJ in load_file(s))
    tensors = load_file(holder)
    tensors[K_PROJ] = torch.zeros(48, 64)
    save_file(tensors, holder, metadata={"format": "pt"})
    assert f"{K_PROJ} is [48, 64] in {holder.name}, config.json makes it [32, 64]" in refusal(tmp_path / "sharded")
    holder.unlink()
    assert f"lists {holder.name}, which is not in" in refusal(tmp_path / "sharded")


def test_a_tied_model_and_a_base_model_saved_alone_import(tmp_path):
    """A saved lm_head.weight of a tied model is dropped by transformers; a base model (LlamaModel)
    has names without ``model.``: both load as transformers loads them."""
    hf = save_llama(tmp_path / "tied", tokenizer=False, tie_word_embeddings=True)
    logits_match(tmp_path / "tied")
    rewrite(tmp_path / "tied", lambda t: t.update({"lm_head.weight": hf.model.embed_tokens.weight.detach().clone()}))
    logits_match(tmp_path / "tied")
    hf.model.save_pretrained(tmp_path / "base")  # LlamaModel: embed_tokens.weight, layers.0..., norm.weight
    edit_config(tmp_path / "base", architectures=["LlamaForCausalLM"])
    assert "embed_tokens.weight" in load_file(tmp_path / "base" / "model.safetensors")
    logits_match(tmp_path / "base")


def test_the_llama_table_has_every_tensor_transformers_has(llama):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    family, cfg = read_model(llama).family, read_model(llama).model_config()
    assert set(check_tensors(llama, family, cfg)) == set(hf.state_dict())
