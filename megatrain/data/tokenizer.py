"""The tokenizer a shard version is written with: trained, a ``tokenizer.json``, or a model's own.

``data.tokenizer`` is one of

- ``bpe``: a byte-level BPE trained on the corpus itself (the demo's choice: no download);
- a ``tokenizer.json`` (a path or URL);
- a Hugging Face model folder: its ``tokenizer.json``, with BOS and EOS taken from its
  ``tokenizer_config.json`` (``eos_token``, ``bos_token``, ``add_bos_token``), so continued
  pretraining separates documents the way the base model learned to.

Whatever the source, the result is a ``TokenizerSpec``: the tokenizer's JSON text, its sha256 (which
names the shard version and is recorded in every checkpoint: a run is refused on data from another
tokenizer), the EOS id that ends every document and the BOS id that starts one when the model's
config asks for it. A file that is not a tokenizer is one error naming the file, never a parser's
traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain import storage
from megatrain.data.index import DataError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class TokenizerSpec:
    json_text: str  # the tokenizer as tokenizers' JSON: a string crosses process boundaries
    sha256: str  # of json_text's bytes: the identity of the tokenizer
    eos_id: int  # ends every document
    bos_id: int | None  # starts every document, when the model's tokenizer config adds one
    source: str  # what data.tokenizer named: "bpe", a tokenizer.json, or a model folder

    @property
    def vocab_size(self) -> int:
        return parse(self.json_text, self.source).get_vocab_size()

    def encode_documents(self, documents: list[str]) -> list[list[int]]:
        """Token ids of each document, BOS first when the tokenizer wants one, EOS last."""
        tokenizer = parse(self.json_text, self.source)
        return [self._frame(encoding.ids) for encoding in tokenizer.encode_batch(documents)]

    def _frame(self, ids: list[int]) -> list[int]:
        """BOS first and EOS last, each once: a tokenizer whose own post-processor already adds
        them (Llama 2's adds BOS, and its tokenizer_config.json asks for BOS too) is not doubled."""
        head = [] if self.bos_id is None or (ids and ids[0] == self.bos_id) else [self.bos_id]
        tail = [] if ids and ids[-1] == self.eos_id else [self.eos_id]
        return head + ids + tail


def use_cores(cores: int) -> None:
    """Give this worker process's tokenizer ``cores`` threads (and Arrow's thread pool as many).
    Call it before the process's first tokenizer or Arrow work: both size their thread pools when
    first used (RAYON_NUM_THREADS, OMP_NUM_THREADS). One core turns the tokenizer's parallelism off,
    which holds at any time: ``encode_batch`` then runs in the calling thread. Without this a
    worker's ``encode_batch`` ran on every core of the machine (173% CPU for one worker on 2
    cores), so a second worker had no core to itself and added nothing."""
    cores = max(1, int(cores))
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if cores > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(cores)
    os.environ["OMP_NUM_THREADS"] = str(cores)
    if "pyarrow" in sys.modules:  # imported already: its pool may exist, resize it
        sys.modules["pyarrow"].set_cpu_count(cores)


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_PARSED: dict[str, Tokenizer] = {}


def parse(json_text: str, source: str) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a JSON text, parsed once per process (tokenizer workers reuse it)."""
    key = hashlib.sha256(json_text.encode()).hexdigest()
    if key not in _PARSED:
        try:
            _PARSED[key] = Tokenizer.from_str(json_text)
        except Exception as exc:  # the Rust parser raises a bare Exception("EOF while parsing ...")
            raise DataError(f"{source}: not a valid tokenizer.json ({str(exc).strip() or type(exc).__name__})") from exc
        while len(_PARSED) > 2:
            _PARSED.pop(next(iter(_PARSED)))
    return _PARSED[key]


def _special_token(value: object) -> str | None:
    """A token of tokenizer_config.json: a string, or {"content": ...} (an AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(url: str) -> dict:
    try:
        data = json.loads(storage.read_bytes(url))
    except json.JSONDecodeError as exc:
        raise DataError(f"{url}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    if not isinstance(data, dict):
        raise DataError(f"{url}: not a JSON object")
    return data


def _token_id(tokenizer: Tokenizer, token: str, source: str, what: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"{source}: has no {what} token {token!r}")
    return token_id


def load_tokenizer(spec: str, eos_token: str, vocab_size: int) -> TokenizerSpec:
    """``data.tokenizer`` when it names a tokenizer.json or a model folder (not ``bpe``)."""
    if not storage.exists(spec):
        raise DataError(f"data.tokenizer {spec}: no such file or folder")
    folder = storage.info(spec).get("type") == "directory"
    json_url = storage.join_url(spec, TOKENIZER_FILE) if folder else spec
    if folder and not storage.exists(json_url):
        raise DataError(f"data.tokenizer {spec}: a folder without {TOKENIZER_FILE} (a model folder with only a "
                        "slow tokenizer, e.g. tokenizer.model, must be converted to tokenizer.json first)")
    raw = storage.read_bytes(json_url)
    try:
        json_text = raw.decode()
    except UnicodeDecodeError as exc:
        raise DataError(f"{json_url}: not a tokenizer.json (not UTF-8 text)") from exc
    tokenizer = parse(json_text, json_url)
    config_url = storage.join_url(spec, CONFIG_FILE) if folder else None
    config = _read_json(config_url) if config_url and storage.exists(config_url) else {}
    eos = _special_token(config.get("eos_token")) or eos_token
    bos = _special_token(config.get("bos_token")) if config.get("add_bos_token") else None
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(f"{json_url}: vocabulary {tokenizer.get_vocab_size()} exceeds the model's {vocab_size} "
                        "(model.vocab_size)")
    where = config_url if config.get("eos_token") else "data.eos_token"
    return TokenizerSpec(
        json_text=json_text, sha256=hashlib.sha256(raw).hexdigest(),
        eos_id=_token_id(tokenizer, eos, f"{json_url} (EOS from {where})", "EOS"),
        bos_id=None if bos is None else _token_id(tokenizer, bos, f"{json_url} (BOS from {config_url})", "BOS"),
        source=spec,
    )


def train_bpe(documents: Iterable[str], vocab_size: int, eos_token: str) -> TokenizerSpec:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``documents``: every byte
    encodable whatever the corpus, ``eos_token`` its one special token."""
    if vocab_size < 257:
        raise DataError(f"vocab size {vocab_size}: a byte-level BPE needs at least 256 bytes + EOS")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    json_text = tokenizer.to_str()
    return TokenizerSpec(json_text=json_text, sha256=hashlib.sha256(json_text.encode()).hexdigest(),
                         eos_id=tokenizer.token_to_id(eos_token), bos_id=None, source="bpe")
