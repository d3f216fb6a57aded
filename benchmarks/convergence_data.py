"""The data of ``convergence.py``: a corpus every machine has, megatrain's own shards of it (a BPE
trained on it, documents held out by hash), the training batches in megatrain's loader order and
the fixed held-out windows. Every run of a comparison reads these, so "the same data" is
megatrain's data path itself, not a copy of it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import numpy as np
import torch

DOC_ROOTS = ("/usr/share/doc", "/usr/share/common-licenses")


def corpus_sources(doc_roots: tuple[str, ...] = DOC_ROOTS) -> list[str]:
    """``stdlib`` plus every regular file under ``doc_roots`` (sorted). Files are listed here, not
    globbed: those trees hold links to folders, which a glob would hand over as files. Binary
    files (images, PDFs) are left to ``data.on_bad_source=skip``, which counts them in the index."""
    files = []
    for root in doc_roots:
        for folder, subdirs, names in os.walk(root):
            subdirs.sort()
            for name in sorted(names):
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    files.append(path)
    return ["stdlib", *files]


def data_config(shard_url: str, vocab_size: int, *, max_source_bytes: int | None = None,
                val_fraction: float = 0.02, doc_roots: tuple[str, ...] = DOC_ROOTS, seed: int = 1234,
                num_workers: int = 0):
    """The ``data:`` section every run of a comparison shares."""
    from megatrain.config.data import DataConfig

    return DataConfig(sources=corpus_sources(doc_roots), on_bad_source="skip", bpe_vocab_size=vocab_size,
                      shard_url=shard_url, max_source_bytes=max_source_bytes, val_fraction=val_fraction,
                      seed=seed, num_workers=num_workers, samples_per_shard=256)


def build_shards(data_cfg, seq_len: int, vocab_size: int):
    """megatrain's shard version of the corpus (reused when it exists): its ShardIndex."""
    from megatrain.data.shard import shard_corpus

    return shard_corpus(data_cfg, seq_len, vocab_size)


def tokenizer_bytes(index) -> bytes:
    from megatrain import storage

    return storage.read_bytes(index.tokenizer_url)


def train_batches(index, data_cfg, batch: int, vocab_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Endless (inputs, targets, crc32 of the inputs) in megatrain's loader order (data.seed,
    data.shuffle_shards): a run in another process gets the same batches, and the digest shows it."""
    from megatrain.data.loader import build_loader

    loader = build_loader(index, micro_batch_size=batch, dp_rank=0, dp_size=1, seed=data_cfg.seed,
                          shuffle_shards=data_cfg.shuffle_shards, vocab_size=vocab_size, prefetch_batches=2)
    try:
        while True:
            inputs, targets = next(loader)
            yield inputs, targets, zlib.crc32(inputs.numpy().tobytes())
    finally:
        loader.close()


def held_out(index, windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``windows`` held-out windows (documents no training shard holds) as (inputs, targets)."""
    from megatrain.data.loader import to_tensors
    from megatrain.evaluate.heldout import held_out_windows

    found = held_out_windows(index, windows)
    if len(found) == 0:
        raise SystemExit(f"{index.url}: no held-out windows ({index.val_note or 'data.val_fraction is 0'})")
    return to_tensors(np.ascontiguousarray(found))


def describe(index, data_cfg, doc_roots: tuple[str, ...] = DOC_ROOTS) -> dict:
    """What the JSON records of the corpus: enough to tell two machines' shards apart."""
    return {"shard_version": index.version, "tokenizer_sha256": index.tokenizer_sha256,
            "vocab_size": index.vocab_size, "train_tokens": index.num_tokens, "train_samples": index.num_samples,
            "val_samples": index.val_num_samples, "val_documents": index.val_documents,
            "input_files": len(index.inputs.get("files", [])), "input_bytes": index.inputs.get("bytes"),
            "skipped_sources": len(index.bad_sources), "val_fraction": data_cfg.val_fraction,
            "data_seed": data_cfg.seed, "roots": ["stdlib", *doc_roots]}
