"""The recipe ``megatrain import`` writes: the base recipe with the model replaced whole, the base's
seq_len, the model's own tokenizer (its BOS and EOS as config.json says), and a run named after
the recipe file, with checkpoints under its own run dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
import yaml

from megatrain.config import load_config, read_yaml
from megatrain.interop.hf import ImportMismatch, hf_weights, import_cli
from megatrain.model import GPT
from tests.megatrain.conftest import ROOT
from tests.megatrain.interop.hf_folders import (
    EOS,
    copy_folder,
    edit_config,
    save_llama,
    save_tokenizer,
)

LLAMA_31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """Llama 3.1's context and RoPE on a tiny model, with its own tokenizer."""
    folder = tmp_path_factory.mktemp("recipe") / "llama-131k"
    save_llama(folder, max_position_embeddings=131072, rope_parameters=LLAMA_31_ROPE)
    return folder


def base_recipe(tmp_path: Path, **sections) -> Path:
    """configs/llama-tiny-cpu.yaml with ``sections`` merged in, written under tmp_path."""
    raw = read_yaml(ROOT / "configs" / "llama-tiny-cpu.yaml")
    for name, fields in sections.items():
        raw[name] = {**raw.get(name, {}), **fields} if isinstance(fields, dict) else fields
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_model_comes_whole_from_config_json_and_the_run_from_out(long_llama, tmp_path, capsys):
    base = base_recipe(
        tmp_path, name="the-base",
        model={"rope_scaling": {"factor": 2.0}, "attention": "sliding", "window": 64, "rope_theta": 10.0,
               "dropout": 0.1, "norm_eps": 1e-3, "kernels": {"attention": "reference"}},
        train={"tensorboard_dir": "/elsewhere/tb"},
        checkpoint={"staging_dir": "/elsewhere/staging", "durable_url": "/elsewhere/checkpoints"})
    out = tmp_path / "exp" / "llama-cpt.yaml"
    assert import_cli(["--hf", str(long_llama), "--config", str(base), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "model.seq_len 128 (the base recipe's); it allows up to 131072" in printed.out, printed.out
    assert printed.err == ""

    recipe = yaml.safe_load(out.read_text())
    model = recipe["model"]
    assert model["seq_len"] == 128  # the base recipe's, not the model's 131072
    assert model["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position": 8192}
    assert (model["rope_theta"], model["norm_eps"], model["dropout"]) == (500000.0, 1e-5, 0.0)
    assert (model["attention"], model["window"]) == ("full", None)  # nothing of the base's model survives
    assert model["kernels"] == {"attention": "reference"}  # but how it runs does
    run_dir = tmp_path / "exp" / "runs" / "llama-cpt"
    assert recipe["name"] == "llama-cpt" and recipe["train"]["run_dir"] == str(run_dir)
    assert "tensorboard_dir" not in recipe["train"]
    assert "staging_dir" not in recipe["checkpoint"] and "durable_url" not in recipe["checkpoint"]
    assert recipe["checkpoint"]["init_from"] == f"hf:{long_llama}"
    assert recipe["data"]["tokenizer"] == str(long_llama) and recipe["data"]["eos_token"] == EOS

    cfg = load_config(out)
    assert cfg.checkpoint.durable_url == f"{run_dir}/checkpoints" and cfg.checkpoint.staging_dir == f"{run_dir}/staging"
    model = GPT(cfg.model)
    hf_weights(cfg.checkpoint.init_from)(model)  # what the run does when it starts: the weights load at 128


def test_seq_len_from_the_command_line(long_llama, tmp_path, capsys):
    out = tmp_path / "r.yaml"
    assert import_cli(["--hf", str(long_llama), "--seq-len", "512", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["model"]["seq_len"] == 512
    assert "model.seq_len 512 (--seq-len); it allows up to 131072" in capsys.readouterr().out


def test_learned_positions_cannot_be_outgrown(tmp_path):
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=384, n_positions=64, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ImportMismatch, match="model.seq_len 128 .* exceeds the 64 learned positions"):
        import_cli(["--hf", str(tmp_path / "gpt2"), "--seq-len", "128", "--out", str(tmp_path / "r.yaml")])
    assert not (tmp_path / "r.yaml").exists()


SPECIAL_IDS = {  # config.json's ids against the tokenizer's (<s> = 0, </s> = 1): what a refusal names
    "EOS of another token": ({"eos_token_id": 0}, "tokenizer_config.json: eos_token '</s>' (id 1) is not"),
    "BOS of another token": ({"bos_token_id": 1}, "documents would start with '<s>' (id 0)"),
    "EOS not in the tokenizer": ({"eos_token_id": 999}, "eos_token_id=999 is not a token of"),
    "a list of EOS ids holding the tokenizer's": ({"eos_token_id": [5, 1]}, None),
}


@pytest.mark.parametrize("name", SPECIAL_IDS)
def test_bos_and_eos_are_config_json_s(name, long_llama, tmp_path):
    keys, refused = SPECIAL_IDS[name]
    folder = copy_folder(long_llama, tmp_path / "llama")
    edit_config(folder, **keys)
    args = ["--hf", str(folder), "--out", str(tmp_path / "r.yaml")]
    if refused is None:
        assert import_cli(args) == 0
        return
    with pytest.raises(ImportMismatch, match=refused.replace("(", r"\(").replace(")", r"\)")):
        import_cli(args)
    assert not (tmp_path / "r.yaml").exists()


def test_a_folder_without_a_tokenizer_keeps_the_recipe_s_only_when_the_vocabularies_agree(tmp_path, capsys):
    save_tokenizer(tmp_path / "tokenizer")  # 384 tokens
    tokenizer_json = tmp_path / "tokenizer" / "tokenizer.json"
    save_llama(tmp_path / "bare", tokenizer=False)  # 384 rows
    save_llama(tmp_path / "wider", tokenizer=False, vocab_size=640)
    capsys.readouterr()  # the folders' building, said on stderr by transformers

    def kept(base: Path) -> tuple[str, str]:
        out = tmp_path / "r.yaml"
        assert import_cli(["--hf", str(tmp_path / "bare"), "--config", str(base), "--out", str(out)]) == 0
        [warning] = capsys.readouterr().err.splitlines()
        assert warning.startswith(f"warning: {tmp_path / 'bare'} has no tokenizer.json: the recipe keeps")
        return warning, yaml.safe_load(out.read_text())["data"]["tokenizer"]

    warning, tokenizer = kept(base_recipe(tmp_path, data={"tokenizer": str(tokenizer_json), "eos_token": EOS}))
    assert tokenizer == str(tokenizer_json) and "(384 tokens for the model's 384 rows)" in warning
    warning, tokenizer = kept(base_recipe(tmp_path, data={"tokenizer": "bpe"}))  # trained at the model's 384
    assert tokenizer == "bpe" and "its ids are not the ones the model learned" in warning

    for data in ({"tokenizer": str(tokenizer_json), "eos_token": EOS}, {"tokenizer": "bpe", "bpe_vocab_size": 384}):
        with pytest.raises(ImportMismatch, match="has 384 tokens where .* has vocab_size 640"):
            import_cli(["--hf", str(tmp_path / "wider"), "--config", str(base_recipe(tmp_path, data=data)),
                        "--out", str(tmp_path / "w.yaml")])
    assert not (tmp_path / "w.yaml").exists()


def line_above(text: str, section: str, key: str) -> str:
    """The line of a YAML text just above ``section``'s ``key``."""
    current, lines = None, text.splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#", "-")):
            current = line.split(":")[0]
        elif current == section and line.startswith(f"  {key}:"):
            return lines[i - 1]
    raise AssertionError(f"{section}.{key} not in the recipe")


def test_the_base_recipe_s_choices_are_named_and_its_caps_dropped(long_llama, tmp_path, capsys):
    """configs/llama-tiny-cpu.yaml is a toy's recipe (the stdlib, 2 MB, LAMB at lr 0.02, warm-up 5):
    the import reads the whole corpus, and names each value it kept for the user to decide."""
    tiny = ROOT / "configs" / "llama-tiny-cpu.yaml"
    out = tmp_path / "cpt.yaml"
    assert import_cli(["--hf", str(long_llama), "--config", str(tiny), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    recipe, text = yaml.safe_load(out.read_text()), out.read_text()
    assert "max_source_bytes" not in recipe["data"] and load_config(out).data.max_source_bytes is None
    assert f"data.max_source_bytes 2000000 of {tiny} dropped" in printed
    base = read_yaml(tiny)
    for section, key, value in [("data", "sources", ["stdlib"]), ("optim", "name", "lamb"), ("optim", "lr", 0.02),
                                ("optim", "warmup_steps", 5), ("train", "steps", base["train"]["steps"])]:
        assert recipe[section][key] == value
        assert f"decide {section}.{key} = {value!r} (from {tiny})" in printed, (section, key)
        above = line_above(text, section, key)
        assert above.startswith("  # decide:") and f"from {tiny}" in above, above
    # the schedule was not in the base recipe: megatrain's default, named as such
    assert recipe["optim"]["schedule"] == "cosine" and "decide optim.schedule = 'cosine' (from megatrain's default)" in printed

    assert import_cli(["--hf", str(long_llama), "--config", str(tiny), "--max-source-bytes", "5000",
                       "--out", str(out)]) == 0  # a cap only when asked
    assert yaml.safe_load(out.read_text())["data"]["max_source_bytes"] == 5000
    assert "data.max_source_bytes 5000 (--max-source-bytes)" in capsys.readouterr().out
