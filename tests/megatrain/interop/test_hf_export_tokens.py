"""An export keeps the tokenizer whole: the base model's special tokens, added tokens, chat
template and config.json ids when the run continues one, the run's own tokenizer's specials
otherwise (none standing in for another), and a context never below the base model's."""

from __future__ import annotations

import json

import pytest
import transformers

from megatrain.config import load_config
from megatrain.interop.hf import ExportRefused, export_model, hf_weights, import_cli
from megatrain.model import GPT
from tests.megatrain.conftest import ROOT
from tests.megatrain.interop.hf_folders import EOS, save_llama, special_tokens
from tests.megatrain.interop.test_hf import SERIAL_GPT, random_model, tokenizer_json  # noqa: F401 (a fixture)

BASE_POSITIONS = 1024


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    """(base folder, config) of a recipe `megatrain import` wrote for a Llama of 1024 positions,
    trained at the base recipe's 128."""
    root = tmp_path_factory.mktemp("continued")
    save_llama(root / "base", max_position_embeddings=BASE_POSITIONS)
    recipe = root / "cpt.yaml"
    assert import_cli(["--hf", str(root / "base"), "--config", str(ROOT / "configs" / "llama-tiny-cpu.yaml"),
                       "--out", str(recipe)]) == 0
    return root / "base", load_config(recipe)


def test_a_continued_model_exports_the_base_model_s_tokenizer_files(continued, tmp_path):
    from megatrain.interop import hf_tokenizer

    base, cfg = continued
    model = GPT(cfg.model)
    hf_weights(cfg.checkpoint.init_from)(model)
    tokenizer_json = (base / "tokenizer.json").read_bytes()
    tokens = hf_tokenizer.resolve(cfg, tokenizer_json, EOS, bos_id=None)
    out = export_model(model, cfg.model, tmp_path / "out", tokenizer_json, cfg.data.eos_token, tokens)

    theirs, ours = transformers.AutoTokenizer.from_pretrained(base), transformers.AutoTokenizer.from_pretrained(out)
    assert special_tokens(ours) == special_tokens(theirs)
    assert ours.pad_token == "<pad>" and ours.unk_token == "<unk>" and ours.bos_token == "<s>"
    chat = [{"role": "user", "content": "def f(x):"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert ours("def f(x):")["input_ids"] == theirs("def f(x):")["input_ids"]

    config, base_config = (json.loads((d / "config.json").read_text()) for d in (out, base))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == base_config[key], key
    assert config["max_position_embeddings"] == BASE_POSITIONS  # not the trained 128
    assert transformers.AutoConfig.from_pretrained(out).max_position_embeddings == BASE_POSITIONS
    assert ours.model_max_length == BASE_POSITIONS
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (base_config["bos_token_id"], base_config["eos_token_id"])


def test_a_run_s_own_tokenizer_exports_its_specials_and_no_alias(tmp_path, tokenizer_json):  # noqa: F811
    """A BPE trained with one special token: EOS is it; no BOS (its documents had none), no unk, no pad."""
    model = random_model(**SERIAL_GPT)
    out = export_model(model, model.cfg, tmp_path / "hf", tokenizer_json)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.bos_token, tokenizer.unk_token, tokenizer.pad_token) == (None, None, None)
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id) == (None, 0)
    assert config.n_positions == model.cfg.seq_len


def test_the_context_is_the_trained_one_never_below_the_base_s_unless_asked():
    from megatrain.config import ModelConfig
    from megatrain.interop import hf_tokenizer

    rope = ModelConfig(**{**SERIAL_GPT, "position": "rope", "bias": True})  # seq_len 32
    learned = ModelConfig(**SERIAL_GPT)
    assert hf_tokenizer.positions(rope, None, None) == (32, None)
    assert hf_tokenizer.positions(rope, 16, None) == (32, None)  # trained past the base's: the trained context
    assert hf_tokenizer.positions(rope, 1024, None)[0] == 1024
    assert hf_tokenizer.positions(rope, 1024, 32)[0] == 32  # asked
    with pytest.raises(ExportRefused, match="--max-positions 16: below the trained context model.seq_len=32"):
        hf_tokenizer.positions(rope, 1024, 16)
    n, note = hf_tokenizer.positions(learned, 1024, None)  # a table of seq_len rows: no more to write
    assert n == 32 and "the base model had 1024" in note
    with pytest.raises(ExportRefused, match="model.position=learned"):
        hf_tokenizer.positions(learned, None, 64)
