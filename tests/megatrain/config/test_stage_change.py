"""The stage rule (megatrain/config/stage_change.py): a context extension is allowed and said in one
line; a change of the model's shapes is refused naming the field and both stages, by the campaign's
validation (before any stage trains) and by the same rule over a checkpoint's recorded fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.config import ConfigError, ModelConfig, load_config
from megatrain.config.campaign import load_campaign
from megatrain.config.stage_change import (
    CONTEXT_FIELDS, LAYOUT_FIELDS, OTHER_MODEL_FIELDS, SHAPE_FIELDS, judge, judge_configs, stage_fields,
)

ROOT = Path(__file__).resolve().parents[3]
LLAMA = ROOT / "configs" / "llama-tiny-cpu.yaml"
LONG = ["model.seq_len=512", "train.seq_len=512", "model.rope_theta=500000", "model.attention_mask=document",
        "parallel.cp=2", "parallel.world_size=2",
        "model.rope_scaling={rope_type: yarn, factor: 8, original_max_position: 64}"]


def llama(*overrides: str):
    return load_config(LLAMA, ["model.seq_len=512", "train.seq_len=64", *overrides])


def test_a_context_extension_is_allowed_and_said_in_one_line():
    change = judge_configs(llama(), llama(*LONG), "short", "long")
    assert change.refusal is None
    assert change.line == ("stage long: context extension from stage short: seq_len 64 -> 512, rope_theta 10000 -> "
                           "500000, rope_scaling none -> yarn (factor 8, original 64), attention_mask causal -> "
                           "document, cp 1 -> 2")


def test_llama3_scaling_and_checkpointing_are_named_too():
    change = judge_configs(llama(), llama("train.seq_len=128", "model.activation_checkpointing=full",
                                          "model.rope_scaling={factor: 2, original_max_position: 64}"), "a", "b")
    assert change.line == ("stage b: context extension from stage a: seq_len 64 -> 128, rope_scaling none -> "
                           "llama3 (factor 2, original 64), activation_checkpointing none -> full")


def test_a_shorter_stage_is_a_change_not_an_extension_and_an_equal_one_says_nothing():
    assert judge_configs(llama("train.seq_len=128"), llama(), "a", "b").line == \
        "stage b: changes from stage a: seq_len 128 -> 64"
    same = judge_configs(llama(), llama("optim.lr=1e-3", "data.max_source_bytes=1000"), "a", "b")
    assert same.line is None and same.refusal is None  # not this rule's fields


@pytest.mark.parametrize("override, field", [
    ("model.n_layer=3", "model.n_layer"), ("model.d_model=256", "model.d_model"), ("model.n_head=8", "model.n_head"),
    ("model.vocab_size=4096", "model.vocab_size"), ("model.n_kv_head=4", "model.n_kv_head"),
    ("model.mlp=gelu", "model.mlp"),
])
def test_a_shape_change_is_refused_naming_the_field_and_both_stages(override, field):
    change = judge_configs(llama(), llama(override), "short", "long")
    assert change.refusal is not None and field in change.refusal
    assert change.refusal.startswith("stage long: changes the model's shapes from stage short: ")


def test_a_learned_table_makes_seq_len_a_shape():
    gpt = ROOT / "configs" / "tiny-cpu.yaml"
    change = judge_configs(load_config(gpt), load_config(gpt, ["model.seq_len=256"]), "a", "b")
    assert "model.seq_len 128 -> 256" in change.refusal


def test_a_checkpoint_without_layout_fields_or_later_knobs_is_judged_on_what_it_has():
    """An older checkpoint's view: no layout fields (not compared), no rope_scaling key (its default)."""
    saved = {k: v for k, v in stage_fields(llama()).items() if k not in LAYOUT_FIELDS and "rope_scaling" not in k}
    change = judge(saved, stage_fields(llama(*LONG)), "short", "long")
    assert "cp 1 -> 2" not in change.line and "rope_scaling none -> yarn" in change.line


def test_every_model_field_is_placed():
    """A new model field must say whether a stage may change it (stage_change.py's lists)."""
    def names(model: type, prefix: str) -> set[str]:
        out = set()
        for name, info in model.model_fields.items():
            nested = info.annotation if isinstance(info.annotation, type) else None
            if name == "moe":
                out |= names(nested, f"{prefix}{name}.")
            else:
                out.add(f"{prefix}{name}")
        return out

    placed = set(SHAPE_FIELDS) | set(CONTEXT_FIELDS) | set(LAYOUT_FIELDS) | set(OTHER_MODEL_FIELDS)
    assert names(ModelConfig, "model.") - placed == set()


CAMPAIGN = """
id: t
recipe: {recipe}
root_dir: {root}
nproc_per_node: 2
overrides: [model.seq_len=512, train.global_batch_size=16]
stages:
  - {{name: short, steps: 5, overrides: [train.seq_len=64]}}
  - {{name: long, steps: 5, overrides: [{override}]}}
"""


def test_the_campaign_refuses_a_shape_change_before_any_stage_trains(tmp_path):
    path = tmp_path / "campaign.yaml"
    path.write_text(CAMPAIGN.format(recipe=LLAMA, root=tmp_path, override="model.n_layer=4"))
    with pytest.raises(ConfigError, match=r"stage long: changes the model's shapes from stage short: "
                                          r"model\.n_layer 2 -> 4"):
        load_campaign(path)
    path.write_text(CAMPAIGN.format(recipe=LLAMA, root=tmp_path, override="model.rope_theta=500000"))
    assert load_campaign(path).stage_change(1).line == \
        "stage long: context extension from stage short: seq_len 64 -> 512, rope_theta 10000 -> 500000"
