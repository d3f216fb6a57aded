"""What an exported folder says about its tokenizer beyond tokenizer.json: the special tokens, the
chat template, the added tokens, the ids in config.json, and the context the base model had.

A run that continues a transformers model trains on that model's own tokenizer (``megatrain
import`` sets ``data.tokenizer`` to the model folder), so its export must say what the base
model's folder says: the same ``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token``, its
chat template and added tokens, and config.json's ``bos_token_id`` / ``eos_token_id`` /
``pad_token_id`` (an EOS list included) and its generation_config.json. Those come from the
files themselves, copied as they are (``tokenizer_config.json``'s ``model_max_length`` is the one
value rewritten: the exported context). Nothing is invented from ``data.eos_token``.

A run on a tokenizer of its own (``bpe``, or a bare tokenizer.json) exports that tokenizer's
specials: its EOS, its BOS only when its documents started with one, its model's ``unk_token``
if it has one, and no pad token; none is another token's alias.

``resolve`` decides which, from the run's config; ``snapshot`` runs it when a run starts and
writes the result beside the checkpoints (``BASE_RECORD``), so an export finds the base model's
files even when the folder the run started from has moved or gone. ``positions`` picks
``max_position_embeddings``: the trained context, never below the base model's unless asked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain import storage
from megatrain.config.run_dirs import HF_PREFIX
from megatrain.errors import InputError
from megatrain.interop.hf_config import family_of_hf

log = logging.getLogger("megatrain.interop")

BASE_RECORD = "hf-base.json"  # beside the checkpoints: the resolved ExportTokens of the run
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# Files of a transformers tokenizer folder besides tokenizer.json, written to the export as they are
TOKENIZER_FILES = (TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
POSITION_KEYS = ("max_position_embeddings", "n_positions")  # config.json's context: GPT-2 says n_positions


@dataclass(frozen=True)
class ExportTokens:
    """The tokenizer side of an export, besides tokenizer.json."""

    files: dict[str, str]  # file name -> text, written as they are (tokenizer_config.json's model_max_length aside)
    ids: dict[str, Any]  # config.json's bos_token_id, eos_token_id (an int or a list), pad_token_id
    base_positions: int | None  # the base model's max_position_embeddings, when the run continued one
    source: str  # where the files came from, for the log line
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ExportTokens:
        return cls(files=dict(raw["files"]), ids=dict(raw["ids"]), base_positions=raw.get("base_positions"),
                   source=raw["source"], notes=list(raw.get("notes", [])))


def _same_place(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _is_folder(url: str | None) -> bool:
    return bool(url) and url != "bpe" and storage.exists(url) and storage.info(url).get("type") == "directory"


def _read_json(url: str) -> dict[str, Any]:
    try:
        found = json.loads(storage.read_bytes(url))
    except ValueError as exc:
        raise InputError(f"{url}: not valid JSON ({exc})") from None
    if not isinstance(found, dict):
        raise InputError(f"{url}: not a JSON object")
    return found


def _token(value: object) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or an AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def model_folder(cfg: Any) -> str | None:
    """The transformers folder the run continues: ``checkpoint.init_from: hf:<dir>``, else (a later
    stage of a campaign starts from the previous stage) ``data.tokenizer`` when it is a model folder."""
    init = cfg.checkpoint.init_from
    if init and init.startswith(HF_PREFIX):
        return init[len(HF_PREFIX):]
    if _is_folder(cfg.data.tokenizer) and storage.exists(storage.join_url(cfg.data.tokenizer, "config.json")):
        return cfg.data.tokenizer
    return None


def _base_positions(folder: str | None) -> int | None:
    url = storage.join_url(folder, "config.json") if folder else None
    if not url or not storage.exists(url):
        return None
    config = _read_json(url)
    return next((config[k] for k in POSITION_KEYS if isinstance(config.get(k), int)), None)


def _config_ids(folder: str, tokenizer: Any) -> dict[str, Any]:
    """config.json's special ids, as transformers reads them: an absent key is its class's default."""
    path = storage.join_url(folder, "config.json")
    config = _read_json(path)
    defaults = family_of_hf(config, path).defaults
    ids = {k: config.get(k, defaults.get(k)) for k in ID_KEYS}
    size = tokenizer.get_vocab_size()
    for key, value in ids.items():
        for one in value if isinstance(value, list) else [value]:
            if one is not None and not (isinstance(one, int) and 0 <= one < size):
                raise InputError(f"{path}: {key}={value!r} is not a token of its tokenizer ({size} tokens)")
    return ids


def _tokenizer_ids(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The special ids a tokenizer_config.json's tokens have in the tokenizer."""
    out = {}
    for key in ID_KEYS:
        token = _token(config.get(key[:-3]))
        out[key] = None if token is None else tokenizer.token_to_id(token)
    return out


def _own(tokenizer: Any, eos_token: str, bos_id: int | None) -> tuple[dict[str, str], dict[str, Any]]:
    """A run's own tokenizer (bpe or a bare tokenizer.json): its specials and nothing else."""
    model = json.loads(tokenizer.to_str()).get("model", {})
    unk = model.get("unk_token") if isinstance(model.get("unk_token"), str) else None
    specials = {"bos_token": None if bos_id is None else tokenizer.id_to_token(bos_id), "eos_token": eos_token,
                "unk_token": unk if unk is not None and tokenizer.token_to_id(unk) is not None else None}
    specials = {k: v for k, v in specials.items() if v is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **specials}
    files = {TOKENIZER_CONFIG: json.dumps(config, indent=2), "special_tokens_map.json": json.dumps(specials, indent=2)}
    ids = {"bos_token_id": bos_id, "eos_token_id": tokenizer.token_to_id(eos_token), "pad_token_id": None}
    return files, ids


def resolve_own(tokenizer_json: bytes, eos_token: str, bos_id: int | None = None, base_positions: int | None = None,
                source: str = "the run's tokenizer", notes: list[str] | None = None) -> ExportTokens:
    """The export of a tokenizer of the run's own: its specials and nothing else."""
    from tokenizers import Tokenizer

    files, ids = _own(Tokenizer.from_str(tokenizer_json.decode()), eos_token, bos_id)
    return ExportTokens(files, ids, base_positions, source=source, notes=notes or [])


def resolve(cfg: Any, tokenizer_json: bytes, eos_token: str, bos_id: int | None) -> ExportTokens:
    """The tokenizer side of a run's export, from its config: the files of the folder whose
    tokenizer.json the run trained on (the base model's, when the run continues one), else the
    run's own tokenizer's specials. ``eos_token`` / ``bos_id``: what ended and started its documents."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    base = model_folder(cfg)
    folder = cfg.data.tokenizer if _is_folder(cfg.data.tokenizer) else None
    notes = []
    if folder is not None:
        ours = hashlib.sha256(tokenizer_json).hexdigest()
        theirs = hashlib.sha256(storage.read_bytes(storage.join_url(folder, "tokenizer.json"))).hexdigest()
        if ours != theirs:  # changed since the shards were written: its files may describe other tokens
            notes.append(f"{folder}/tokenizer.json is not the one the run trained on (sha256 {theirs[:12]} vs "
                         f"{ours[:12]}): the export describes the run's own tokens instead of that folder's files")
            folder = None
    if folder is None:
        return resolve_own(tokenizer_json, eos_token, bos_id, _base_positions(base), notes=notes)
    files = {}
    for name in TOKENIZER_FILES:
        url = storage.join_url(folder, name)
        if storage.exists(url):
            files[name] = storage.read_bytes(url).decode()
    config = json.loads(files[TOKENIZER_CONFIG]) if TOKENIZER_CONFIG in files else {}
    if base is not None and _same_place(base, folder):  # the base model's own: its config.json's ids, exactly
        ids = _config_ids(folder, tokenizer)
        generation = storage.join_url(folder, GENERATION_CONFIG)
        if storage.exists(generation):
            files[GENERATION_CONFIG] = storage.read_bytes(generation).decode()
    else:
        ids = _tokenizer_ids(config, tokenizer)
    if TOKENIZER_CONFIG not in files:  # a folder of tokenizer.json alone: the run's specials in the usual file
        own, _ = _own(tokenizer, eos_token, bos_id)
        files[TOKENIZER_CONFIG] = own[TOKENIZER_CONFIG]
    return ExportTokens(files, ids, _base_positions(base), source=folder, notes=notes)


def snapshot(cfg: Any, tokenizer_json: bytes, eos_id: int, bos_id: int | None) -> None:
    """At the start of a run: the resolved tokenizer side of its export, beside its checkpoints."""
    from tokenizers import Tokenizer

    eos_token = Tokenizer.from_str(tokenizer_json.decode()).id_to_token(eos_id)
    tokens = resolve(cfg, tokenizer_json, eos_token, bos_id)
    storage.write_bytes(storage.join_url(cfg.checkpoint.durable_url, BASE_RECORD),
                        json.dumps(tokens.to_json(), indent=1).encode())


def for_run(run: Any) -> ExportTokens:
    """The tokenizer side of a loaded run's export: its snapshot beside the checkpoints (runs
    since megatrain wrote one), else resolved from its config now."""
    url = storage.join_url(run.durable_url, BASE_RECORD)
    if storage.exists(url):
        return ExportTokens.from_json(_read_json(url))
    return resolve(run.cfg, run.tokenizer_bytes(), run.cfg.data.eos_token, run.bos_id())


def positions(cfg: Any, base: int | None, asked: int | None) -> tuple[int, str | None]:
    """config.json's context: the trained ``model.seq_len``, or the base model's when longer
    (RoPE computes any position; training at a shorter context does not shrink the model), or
    ``asked``. Learned positions are a table of seq_len rows: exactly that. (n, a line saying why)"""
    from megatrain.interop.mapping import ExportRefused

    seq_len = cfg.seq_len
    if cfg.position == "learned":
        if asked not in (None, seq_len):
            raise ExportRefused(f"--max-positions {asked}: model.position=learned holds a table of exactly "
                                f"model.seq_len={seq_len} positions")
        if base and base > seq_len:
            return seq_len, (f"{seq_len} learned positions (the trained table; the base model had {base}, "
                             "the rows past the trained context were not kept)")
        return seq_len, None
    if asked is not None:
        if asked < seq_len:
            raise ExportRefused(f"--max-positions {asked}: below the trained context model.seq_len={seq_len}")
        return asked, f"max_position_embeddings {asked} (--max-positions)"
    if base and base > seq_len:
        return base, f"max_position_embeddings {base}, the base model's (trained at {seq_len}; --max-positions N to set it)"
    return seq_len, None


def write(out: Any, tokens: ExportTokens, tokenizer_json: bytes, max_positions: int) -> None:
    """tokenizer.json as the run trained it and the tokenizer files beside it."""
    (out / "tokenizer.json").write_bytes(tokenizer_json)
    for name, text in tokens.files.items():
        if name == TOKENIZER_CONFIG:
            config = json.loads(text)
            config["model_max_length"] = max_positions
            text = json.dumps(config, indent=2)
        (out / name).write_text(text)
