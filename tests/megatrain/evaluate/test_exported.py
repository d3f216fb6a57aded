"""The export check through a real run continuing a small Llama with its own tokenizer (BOS
added by its post-processor, its own unk and pad, a chat template): transformers generates the
same token ids as megatrain, the check and the report say "same", and the exported tokenizer's
special tokens are the base model's, even after the base folder has moved away."""

from __future__ import annotations

import json

import pytest
import transformers

from megatrain.evaluate.exported import export_and_check
from megatrain.interop.hf import export_checkpoint, import_cli
from megatrain.report.campaign import _export_markdown
from tests.megatrain.conftest import ROOT
from tests.megatrain.interop.hf_folders import save_llama, special_tokens

PROMPTS = ["def wrap(text", "import ", "class TextWrapper:\n    "]


def test_first_difference():
    from megatrain.evaluate.exported import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 7]) == 2  # one stopped at its EOS, the other went on


def test_the_report_says_same_from_the_ids_not_the_texts():
    """Equal texts can come from different ids (a special token decoded to nothing, a split word):
    the report goes by the ids; an export.json from before the ids were kept compares its texts."""
    base = {"exported": True, "path": "/m", "architecture": "LlamaForCausalLM", "step": 2, "max_logit_diff": 0.0}
    parted = {"prompt": "def ", "prompt_ids": [0, 5], "megatrain_ids": [7, 8], "transformers_ids": [7, 9, 1],
              "same": False, "first_difference": 1, "megatrain": "def f", "transformers": "def f",
              "tokenizer_same": False, "transformers_prompt_ids": [5]}
    agreed = {**parted, "prompt": "import ", "transformers_ids": [7, 8], "same": True, "first_difference": None,
              "tokenizer_same": True}
    del agreed["transformers_prompt_ids"]
    old = {"prompt": "class ", "megatrain": "class A", "transformers": "class A"}
    report = "\n".join(_export_markdown({**base, "samples": [parted, agreed, old]}))
    assert "* `def `: DIFFERENT from generated token 1" in report, report
    assert "* `import `: same" in report and "* `class `: same" in report, report
    assert "encodes this prompt as [5], the run's documents started as [0, 5]" in report, report
    assert report.count("transformers:") == 1  # both texts only where the ids differ


@pytest.mark.slow
def test_a_continued_llama_exports_whole_and_its_check_says_same(run_training, tmp_path):
    save_llama(tmp_path / "base", max_position_embeddings=1024)
    base_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    base_config = json.loads((tmp_path / "base" / "config.json").read_text())
    recipe = tmp_path / "cpt.yaml"
    assert import_cli(["--hf", str(tmp_path / "base"), "--config", str(ROOT / "configs" / "llama-tiny-cpu.yaml"),
                       "--out", str(recipe)]) == 0
    run_training(["data.max_source_bytes=300000", "train.steps=2", "checkpoint.interval=2", "optim.lr=1e-3",
                  "model.kernels.cross_entropy=reference"], name="cpt", config=recipe)

    result = export_and_check(str(tmp_path / "cpt"), tmp_path / "out", PROMPTS)
    assert result["exported"] and result["max_logit_diff"] < 1e-4
    report = "\n".join(_export_markdown(result))
    assert "DIFFERENT" not in report and "<s>" not in report, report
    assert all(f"* `{p}`: same" in report for p in PROMPTS), report

    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert special_tokens(exported) == special_tokens(base_tokenizer)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == \
        [base_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    assert config["max_position_embeddings"] == 1024  # trained at 128: never below the base model's

    for sample in result["samples"]:
        assert sample["prompt_ids"][0] == base_config["bos_token_id"]  # a document's start, as the data had it
        assert sample["same"] and sample["megatrain_ids"] == sample["transformers_ids"], sample
        assert sample["tokenizer_same"] and len(sample["megatrain_ids"]) > 0
    assert result["greedy_same"] == len(PROMPTS)

    # the base folder gone from where the run started: the run's snapshot beside its checkpoints still says it all
    (tmp_path / "base").rename(tmp_path / "moved")
    export_checkpoint(str(tmp_path / "cpt"), tmp_path / "again")
    assert special_tokens(transformers.AutoTokenizer.from_pretrained(tmp_path / "again")) == special_tokens(base_tokenizer)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["max_position_embeddings"] == 1024
