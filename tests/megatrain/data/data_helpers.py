"""Helpers shared by the data tests (a module of its own: test files import it by name,
which would be ambiguous for ``conftest``, of which the test tree has several)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from megatrain import storage
from megatrain.config import DataConfig
from megatrain.data.index import ShardIndex
from megatrain.data.shard_format import decode_shard

SEQ_LEN = 32
VOCAB = 512
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_corpus(root: Path) -> Path:
    """.py and .md files plus a JSONL of documents, cut from the standard library's own text."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("textwrap.py", "colorsys.py", "bisect.py", "fnmatch.py"):
        shutil.copy(STDLIB / name, root / name)
    doc = (STDLIB / "this.py").read_text()  # the Zen of Python, rot13: real text of odd letters
    (root / "notes.md").write_text("# Notes\n\n" + (STDLIB / "heapq.py").read_text()[:6000] + doc)
    difflib = (STDLIB / "difflib.py").read_text()
    with open(root / "docs.jsonl", "w") as handle:
        for i in range(0, 20000, 2000):
            handle.write(json.dumps({"id": i, "text": difflib[i:i + 2000]}) + "\n")
    return root


def data_config(sources: list[str], shard_url: str, **kw: object) -> DataConfig:
    return DataConfig(sources=sources, shard_url=shard_url, samples_per_shard=kw.pop("samples_per_shard", 50), **kw)


def all_windows(index: ShardIndex) -> list[np.ndarray]:
    """Every shard decoded, straight from storage: [samples, seq_len + 1] per shard."""
    return [decode_shard(index.shard_url(i), storage.read_bytes(index.shard_url(i)), s.num_samples,
                         index.seq_len, index.np_dtype) for i, s in enumerate(index.shards)]
