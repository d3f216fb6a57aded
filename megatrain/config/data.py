"""The data's knobs: where text comes from (sources, or a weighted mixture of named components),
how it becomes shards (tokenizer, units, engine) and how shards are read. One section of
``megatrain.config.Config`` (``data:`` in a recipe); like the rest of the package it imports
neither torch nor prefect.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from megatrain.config.section import _Section

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a component name is also a folder and a metric key


class MixtureComponent(_Section):
    """One named part of a blend: its own sources, sharded once into its own shard version."""

    name: str = Field(description="names the component in metrics, status and the report (letters, digits, . _ -)")
    sources: list[str] = Field(min_length=1, description="paths, globs or URLs, as data.sources")
    weight: float = Field(gt=0, description="its share of the samples (weights are normalised to sum 1)")
    text_field: str | None = Field(None, description="the JSONL key or Parquet/Arrow column; default data.text_field")

    @field_validator("name")
    @classmethod
    def _folder_safe(cls, name: str) -> str:
        if not _NAME.match(name) or len(name) > 64:
            raise ValueError(f"component name {name!r}: use letters, digits, '.', '_' and '-' (at most 64), "
                             "starting with a letter or digit")
        return name


class DataCursor(_Section):
    """Where one component's own sample order stood when the previous stage ended (megatrain/data/position.py)."""

    version: str = Field(description="the shard version whose order it is")
    seed: int = Field(description="data.seed of that stage")
    shuffle_shards: int = Field(ge=0, description="data.shuffle_shards of that stage")
    mixture: bool = Field(description="a mixture component's order (seeded by seed and name), or the single version's")
    samples: int = Field(ge=0, description="samples of that order consumed so far, all earlier stages together")
    epoch_len: int = Field(gt=0, description="samples of one epoch of that order (samples // epoch_len: its epoch)")


class DataConfig(_Section):
    """Where text comes from, how it becomes shards, and how shards are read."""

    sources: list[str] = Field(
        default_factory=lambda: ["stdlib"],
        description="paths, globs or URLs of text, JSONL (plain, .gz, .zst), Parquet files or Arrow dataset "
        "folders, recognised by their content; 'stdlib' = the Python standard library's own source, present "
        "offline wherever megatrain is installed",
    )
    mixture: list[MixtureComponent] | None = Field(
        None, description="a weighted blend of named components ({name, sources, weight}) instead of sources: "
        "each component is sharded into its own version, and samples are interleaved by weight at every prefix "
        "of the run",
    )
    on_exhausted: Literal["repeat", "stop"] = Field(
        "repeat", description="a mixture component that runs out of samples: repeat it (a new, reshuffled epoch, "
        "counted and warned) or stop (refused before training when the run would need more than it holds)",
    )
    text_field: str = Field("text", description="the JSONL key, or the Parquet/Arrow column, holding the document text")
    max_source_bytes: int | None = Field(None, gt=0, description="stop reading sources after this many bytes")
    on_bad_source: Literal["error", "skip"] = Field(
        "error", description="a source file that is binary, compressed in an unknown way, truncated or corrupt: "
        "stop with its name (error), or leave it out, counted in the index (skip)",
    )
    tokenizer: str = Field(
        "bpe", description="'bpe' trains a byte-level BPE on the corpus; else a tokenizer.json, or a Hugging Face "
        "model folder (its tokenizer.json, with BOS/EOS from its tokenizer_config.json)",
    )
    bpe_vocab_size: int | None = Field(
        None, ge=257, description="vocabulary of the trained BPE; default model.vocab_size (never more)"
    )
    eos_token: str = Field("<|endoftext|>", description="the token that ends each document (a model folder's own wins)")
    shard_url: str = Field("data/shards", description="fsspec URL where shard versions are written")
    samples_per_shard: int = Field(1024, gt=0)
    unit_bytes: int = Field(
        64 << 20, ge=1 << 16, description="input bytes per sharding work unit (Parquet row groups, JSONL byte "
        "ranges, groups of small files): the grain that workers share and that a rerun skips when done",
    )
    engine: Literal["local", "dask"] = Field(
        "local", description="where the shard-data flow runs its units: a local process pool, or a dask.distributed "
        "cluster (data.dask_address, else a LocalCluster of data.num_workers workers); every engine writes the same index",
    )
    dask_address: str | None = Field(None, description="the Dask scheduler (tcp://host:8786) for data.engine=dask")
    num_workers: int = Field(0, ge=0, description="tokenizer processes while sharding; 0 = one per CPU core")
    worker_cores: int = Field(
        0, ge=0, description="cores each sharding worker is given, and so its tokenizer's (and Arrow's) threads; "
        "0 = the machine's cores shared out among its workers (a Dask worker: its cores over its task threads)",
    )
    max_replaced_fraction: float = Field(
        0.001, ge=0.0, le=1.0, description="share of a text or JSONL file's bytes that may be invalid UTF-8 (each such "
        "byte becomes U+FFFD and is counted per file in the shard index, status and report); a file above it is a bad "
        "source (data.on_bad_source). The standard library's own files are counted, never refused",
    )
    seed: int = 1234
    shuffle_shards: int = Field(
        64, ge=0, description="shards shuffled together (each read once per epoch); 0 = one global permutation"
    )
    prefetch_batches: int = Field(4, ge=0, description="bounded queue of preprocessed batches; 0 = synchronous")
    on_bad_shard: Literal["error", "skip"] = "error"
    verify_checksums: bool = True
    cursors: dict[str, DataCursor] | None = Field(
        None, description="set by a campaign for every stage after the first (its data_cursor: continue, the "
        "default): each component's cursor where the previous stage left it, so this stage serves each one's next "
        "samples in its own order, and its epoch counts on when it wraps. A component without one, or whose shard "
        "version, seed or shuffle window differ from its cursor's, starts at its sample 0 (logged). None: every "
        "component from its sample 0",
    )
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="documents held out for validation, chosen by a hash of their text (so "
        "a duplicate never lands on both sides), packed into their own shards; 0 = no validation split",
    )

    @model_validator(mode="after")
    def _one_corpus(self) -> DataConfig:
        if self.mixture is not None:
            if not self.mixture:
                raise ValueError("data.mixture: list at least one component (or leave it out and use data.sources)")
            if self.sources != ["stdlib"]:
                raise ValueError("data.sources and data.mixture both set: a mixture lists each component's sources")
            names = [c.name for c in self.mixture]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"data.mixture: component names must be unique, {duplicates} repeat")
        if self.engine == "dask" and self.dask_address is not None and not re.match(r"^[a-z]+://", self.dask_address):
            raise ValueError(f"data.dask_address {self.dask_address!r}: a scheduler address such as tcp://host:8786")
        return self

    def components(self) -> list[MixtureComponent]:
        """The corpus as components: the mixture's, or the sources as one component called 'data'."""
        return list(self.mixture) if self.mixture is not None else [
            MixtureComponent(name="data", sources=self.sources, weight=1.0)]
