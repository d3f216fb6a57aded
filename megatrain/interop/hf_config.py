"""A transformers model folder's config.json -> the megatrain model it describes, every key accounted for.

``read_model`` reads config.json, picks the family by ``model_type`` (``FAMILIES``), lets the
family map its keys to ``ModelConfig`` fields (``gpt2.py``, ``llama.py``, ``neox.py``, MoE in
``moe_config.py``; RoPE in ``hf_rope.py``), and then refuses every key of the file that nothing read and that is not on a
list of keys known to change nothing megatrain computes (``NEUTRAL``, ``NEUTRAL_AT``, a family's
``neutral``). A key transformers would honour and megatrain silently ignored would import a
different model than the published one; a refusal is one ``ImportMismatch`` line naming
config.json, the key, its value and why.

The BOS and EOS ids are read here too (``HFModel.bos_id``, ``eos_ids``): ``hf_import`` checks them
against the folder's tokenizer, whose ids the data pipeline writes.

``family_for`` goes the other way, for export: the family whose architecture computes a
megatrain model exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megatrain.config import ModelConfig
from megatrain.interop.gpt2 import GPT2
from megatrain.interop.llama import LLAMA, MISTRAL
from megatrain.interop.mapping import ExportRefused, Family, HFConfig, ImportMismatch
from megatrain.interop.moe import MOE_FAMILIES
from megatrain.interop.moe_config import NOT_COMPUTED
from megatrain.interop.neox import NEOX_PARALLEL, NEOX_SERIAL

FAMILIES: tuple[Family, ...] = (GPT2, LLAMA, MISTRAL, NEOX_SERIAL, NEOX_PARALLEL, *MOE_FAMILIES)
CONFIG_FILE = "config.json"

_RUNTIME = "a switch of transformers' own forward or loading code; the logits are the same"
_GENERATION = "a default of transformers' generate() (old configs kept them here); training never samples"
_HEADS = "for task heads or encoder-decoder models megatrain does not build"
# Keys any transformers config.json may hold that change nothing megatrain computes from the
# weights, with the reason. Keys of one architecture are its Family.neutral.
NEUTRAL: dict[str, str] = {
    "transformers_version": "which transformers wrote the file",
    "_name_or_path": "where transformers loaded the file from",
    "_commit_hash": "where transformers loaded the file from",
    "torch_dtype": "the weights' storage type: each tensor is read in its own dtype, the recipe's precision trains it",
    "dtype": "the weights' storage type: each tensor is read in its own dtype, the recipe's precision trains it",
    "initializer_range": "how transformers initialises weights it does not load: every weight is loaded",
    "pad_token_id": "megatrain packs documents into full windows: nothing is ever padded",
    "use_cache": _RUNTIME, "return_dict": _RUNTIME, "output_attentions": _RUNTIME, "output_hidden_states": _RUNTIME,
    "torchscript": _RUNTIME, "use_bfloat16": _RUNTIME, "_attn_implementation": _RUNTIME,
    "attn_implementation": _RUNTIME, "_attn_implementation_autoset": _RUNTIME, "chunk_size_feed_forward": _RUNTIME,
    "tf_legacy_loss": _RUNTIME, "is_decoder": _RUNTIME,
    **{key: _HEADS for key in ("id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
                               "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id",
                               "tie_encoder_decoder", "cross_attention_hidden_size", "tokenizer_class")},
    **{key: _GENERATION for key in (
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
        "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
        "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens")},
}
# Keys that change nothing at the value a decoder-only causal LM has; another value is refused.
NEUTRAL_AT: dict[str, Any] = {"is_encoder_decoder": False, "add_cross_attention": False, "pruned_heads": {}}


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of a model folder as a dict, or one ImportMismatch line naming what is wrong."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ImportMismatch(f"{hf_dir}: no such folder (a local transformers model folder, saved with save_pretrained)"
                             if not hf_dir.exists() else f"{hf_dir}: not a folder (a transformers model folder)")
    path = hf_dir / CONFIG_FILE
    if not path.is_file():
        raise ImportMismatch(f"{hf_dir}: no {CONFIG_FILE} (a transformers model folder, saved with save_pretrained)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ImportMismatch(f"{path}: not valid JSON (JSON decode error: {exc.msg} at line {exc.lineno} "
                             f"column {exc.colno})") from None
    except UnicodeDecodeError:
        raise ImportMismatch(f"{path}: not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise ImportMismatch(f"{path}: not a JSON object")
    return data


def family_of_hf(hf_config: dict[str, Any], path: str = CONFIG_FILE) -> Family:
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if family.model_type == model_type and family.imports(hf_config):
            return family
    known = ", ".join(dict.fromkeys(f.model_type for f in FAMILIES))
    why = f"{NOT_COMPUTED[model_type]}; " if model_type in NOT_COMPUTED else ""
    raise ImportMismatch(f"{path}: model_type={model_type!r}: {why}megatrain imports {known}")


def family_for(cfg: ModelConfig) -> Family:
    """The family that expresses ``cfg`` exactly, or ExportRefused naming the field."""
    reasons: dict[str, str] = {}  # architecture -> its first reason (GPT-NeoX has two families)
    for family in FAMILIES:
        reason = family.refusal(cfg)
        if reason is None:
            return family
        reasons.setdefault(family.architecture, reason)
    raise ExportRefused("no Hugging Face architecture computes this model exactly; "
                        + "; ".join(f"{arch}: {why}" for arch, why in reasons.items()))


@dataclass(frozen=True)
class HFModel:
    """What a config.json describes: the family, the ModelConfig fields at the folder's own context
    (``seq_len`` = its max positions) and the special token ids."""

    family: Family
    fields: dict[str, Any]
    bos_id: int | None
    eos_ids: tuple[int, ...]  # transformers allows a list: generation stops at any of them
    path: str  # the config.json

    @property
    def max_positions(self) -> int:
        return self.fields["seq_len"]

    def model_config(self, **changes: Any) -> ModelConfig:
        return ModelConfig(**{**self.fields, **changes})


def _special_ids(hf: HFConfig) -> tuple[int | None, tuple[int, ...]]:
    bos, eos = hf["bos_token_id"], hf["eos_token_id"]
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    for key, ids in (("bos_token_id", () if bos is None else (bos,)), ("eos_token_id", eos_ids)):
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise hf.refuse(key, "not a token id")
    return bos, eos_ids


def check_every_key(hf: HFConfig, family: Family) -> None:
    """Refuse the first key of config.json that nothing mapped and that is not known to change nothing."""
    for key in dict.keys(hf):
        if key in hf.read or key in NEUTRAL or key in family.neutral:
            continue
        if key in NEUTRAL_AT:
            if dict.__getitem__(hf, key) != NEUTRAL_AT[key]:
                raise hf.refuse(key, f"a decoder-only causal LM has {NEUTRAL_AT[key]!r}")
            continue
        raise hf.refuse(key, f"megatrain does not map this key and does not know it to change nothing for "
                        f"{family.architecture} (hf_config.NEUTRAL lists those it does)")


def read_model(hf_dir: str | Path) -> HFModel:
    """The megatrain model a transformers folder's config.json describes, every key mapped or refused."""
    raw = read_hf_config(hf_dir)
    path = str(Path(hf_dir) / CONFIG_FILE)
    family = family_of_hf(raw, path)
    hf = HFConfig(raw, path, family.defaults)
    hf.get("model_type")  # mapped: it chose the family
    architectures = hf.get("architectures")
    if architectures not in (None, [family.architecture]):
        raise hf.refuse("architectures", f"megatrain imports {family.architecture} (a causal LM with its LM head)")
    fields = family.model_config(hf)
    bos, eos = _special_ids(hf)
    check_every_key(hf, family)
    try:
        ModelConfig(**fields)
    except ValidationError as exc:  # shapes that do not fit together, e.g. an odd head_dim for RoPE
        first = exc.errors()[0]
        field = ".".join(["model", *map(str, first["loc"])])
        raise ImportMismatch(f"{path}: describes no valid megatrain model ({field}: {first['msg']})") from None
    return HFModel(family=family, fields=fields, bos_id=bos, eos_ids=eos, path=path)


def model_config_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """The ``model`` fields of a recipe that match a transformers folder, at its own context length."""
    return read_model(hf_dir).fields


def at_seq_len(fields: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """``fields`` for training at ``seq_len``: a sliding window at least that long is full attention."""
    out = {**fields, "seq_len": seq_len}
    if out.get("attention") == "sliding" and out["window"] >= seq_len:
        out.update(attention="full", window=None)
    return out
