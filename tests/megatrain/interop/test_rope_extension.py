"""RoPE extension: a tiny Llama with YaRN or Llama 3 scaling at 4x its original context, exported to
Hugging Face; transformers' LlamaForCausalLM gives megatrain's logits at the longer length (fp32), the
frequencies and attention factor are transformers' own, and import reads the same scaling back."""

import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from megatrain.config import ModelConfig
from megatrain.interop.hf import export_model, model_config_from_hf
from megatrain.kernels.rope import rope_inv_freq, rope_scale
from megatrain.model import GPT

V, ORIGINAL, LONG = 320, 32, 128  # trained at 32 tokens, extended to 128 (factor 4)
LLAMA = {"vocab_size": V, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "d_ff": 96, "seq_len": LONG,
         "block": "serial", "attention": "full", "position": "rope", "norm": "rmsnorm", "mlp": "swiglu",
         "bias": False, "tie_embeddings": False, "rope_theta": 50000.0}
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position": ORIGINAL},
    "yarn beta 16/2, mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position": ORIGINAL,
                               "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn attention_factor, no truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position": ORIGINAL,
                                           "attention_factor": 1.3, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position": ORIGINAL},
}


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    return tokenizer.to_str().encode()


def random_model(scaling: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**LLAMA, rope_scaling=scaling))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


@pytest.mark.parametrize("name", SCALINGS)
def test_exported_extension_gives_megatrains_logits_at_the_longer_length(name, tmp_path, tokenizer_json):
    model = random_model(SCALINGS[name])
    out = export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    written = json.loads((out / "config.json").read_text())
    rope = written["rope_parameters"]
    assert rope["rope_type"] == SCALINGS[name]["rope_type"] and rope["rope_theta"] == LLAMA["rope_theta"]
    assert rope["original_max_position_embeddings"] == ORIGINAL and written["max_position_embeddings"] == LONG

    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    # transformers' own frequencies and attention factor, computed from the written config.json
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf.config, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(model.cfg.head_dim, model.cfg.rope_theta, model.cfg.rope_scaling), hf_inv)
    assert rope_scale(model.cfg.rope_scaling) == pytest.approx(hf_scale, rel=1e-12)
    if name.startswith("yarn"):
        assert hf_scale != 1.0  # the attention factor is exercised

    idx = torch.randint(0, V, (2, LONG), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5)
    # and at the original length the positions agree too (a prefix of the same tables)
    with torch.no_grad():
        short = model(idx[:, :ORIGINAL])
    torch.testing.assert_close(short, hf(idx[:, :ORIGINAL]).logits,
                               rtol=1e-5, atol=2e-5)

    back = ModelConfig(**model_config_from_hf(out))
    assert back.rope_scaling == model.cfg.rope_scaling and back.rope_theta == model.cfg.rope_theta
    assert back.seq_len == LONG


def test_yarn_without_its_original_context_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="original_max_position"):
        ModelConfig(**LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0})
