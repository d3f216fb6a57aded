"""The data pipeline on remote storage, end to end: shard -> index -> loader over real servers.

S3: a real S3-compatible server (moto_server). HDFS: no real HDFS can run here; the WebHDFS
*stand-in* in webhdfs_standin.py speaks the REST protocol (with the namenode -> datanode
redirects) that fsspec's client and real namenodes use.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_helpers import SEQ_LEN, VOCAB, all_windows, data_config

from megatrain import storage
from megatrain.data.index import BadShardError
from megatrain.data.loader import build_loader
from megatrain.data.shard import load_index, shard_corpus


def same_batches(a, b, n: int = 6) -> bool:
    return all(torch.equal(next(a)[0], next(b)[0]) for _ in range(n))


def loader_for(index, **kw):
    return build_loader(index, micro_batch_size=4, dp_rank=0, dp_size=1, seed=2, prefetch_batches=2, **kw)


# ------------------------------------------------------------------------------------- WebHDFS
def test_storage_api_over_webhdfs(webhdfs, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_HDFS_USER", "trainer")
    url = storage.join_url(webhdfs.url, "ckpt", "step-10", "manifest.json")
    storage.write_bytes(url, b'{"step": 10}')
    storage.write_bytes(url, b'{"step": 11}')  # HDFS RENAME refuses an existing target: replaced anyway
    assert storage.read_bytes(url) == b'{"step": 11}'
    assert storage.exists(url) and not storage.exists(url + ".missing")
    assert storage.list(storage.parent_url(url)) == [url]  # no temporary file left behind
    local = tmp_path / "weights.bin"
    local.write_bytes(b"\x01" * 100_000)
    storage.put_file(str(local), storage.join_url(webhdfs.url, "ckpt", "weights.bin"))
    assert storage.size(storage.join_url(webhdfs.url, "ckpt", "weights.bin")) == 100_000
    # hdfs:// URLs reach the same namenode through WebHDFS
    assert storage.read_bytes(f"hdfs://127.0.0.1:{webhdfs.port}/ckpt/step-10/manifest.json") == b'{"step": 11}'
    storage.rm(storage.join_url(webhdfs.url, "ckpt"), recursive=True)
    assert not storage.exists(url)
    users = {op[3] for op in webhdfs.ops}
    assert users == {"trainer"}  # the user came from the environment, not from code
    assert any(op[1] == "CREATE" and op[4] for op in webhdfs.ops)  # the body went to the "datanode"


@pytest.mark.slow
def test_shard_and_load_over_webhdfs(small_index, corpus, webhdfs):
    index = shard_corpus(data_config([str(corpus)], webhdfs.url + "/data/shards"), SEQ_LEN, VOCAB)
    assert index.url == f"{webhdfs.url}/data/shards/{small_index.version}"
    assert [s.sha256 for s in index.shards] == [s.sha256 for s in small_index.shards]  # byte-identical
    assert load_index(index.url) == index
    assert same_batches(loader_for(index), loader_for(small_index))
    # the hdfs:// spelling of the same directory works for readers too
    hdfs_index = load_index(f"hdfs://127.0.0.1:{webhdfs.port}/data/shards/{index.version}")
    assert same_batches(loader_for(hdfs_index), loader_for(small_index))
    # re-running finds the finished index on HDFS and writes nothing
    creates = sum(op[1] == "CREATE" for op in webhdfs.ops)
    assert shard_corpus(data_config([str(corpus)], webhdfs.url + "/data/shards"), SEQ_LEN, VOCAB) == index
    assert sum(op[1] == "CREATE" for op in webhdfs.ops) == creates


def test_truncated_shard_on_webhdfs_is_named(small_index, corpus, webhdfs):
    index = shard_corpus(data_config([str(corpus)], webhdfs.url + "/s"), SEQ_LEN, VOCAB)
    path = webhdfs.root / "s" / index.version / index.shards[0].name
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(BadShardError, match=f"{index.shard_url(0)}: .*bytes, the index says"):
        loader = build_loader(index, micro_batch_size=4, dp_rank=0, dp_size=1, seed=2, prefetch_batches=0, shuffle_shards=0)
        for _ in range(index.num_samples // 4):
            next(loader)


def test_unreachable_namenode_is_an_error_not_a_missing_file():
    with pytest.raises(storage.StorageError, match="webhdfs://127.0.0.1:9/x/index.json: ConnectionError"):
        storage.exists("webhdfs://127.0.0.1:9/x/index.json")


# ------------------------------------------------------------------------------------------ S3
def test_shard_from_and_to_s3(small_index, corpus, s3_server):
    # sources on S3 too: the corpus uploaded, read back through a glob URL
    for path in sorted(corpus.iterdir()):
        storage.put_file(str(path), storage.join_url(s3_server, "corpus", path.name))
    assert len(storage.glob(s3_server + "/corpus/*")) == 6
    cfg = data_config([s3_server + "/corpus/*"], s3_server + "/shards")
    index = shard_corpus(cfg, SEQ_LEN, VOCAB)
    assert index.url.startswith(s3_server + "/shards/")
    assert index.num_samples == small_index.num_samples
    np.testing.assert_array_equal(np.concatenate(all_windows(index)), np.concatenate(all_windows(small_index)))
    assert shard_corpus(cfg, SEQ_LEN, VOCAB) == index  # the index on S3 is found again
    assert same_batches(loader_for(index), loader_for(small_index))
    saved = json.loads(storage.read_bytes(storage.join_url(index.url, "index.json")))
    assert saved["version"] == index.version and "url" not in saved


def test_s3_errors_name_the_url(s3_server):
    with pytest.raises(storage.StorageError, match=f"{s3_server}/nope/file.bin: not found"):
        storage.read_bytes(s3_server + "/nope/file.bin")


def test_parquet_and_compressed_jsonl_on_s3_read_as_they_do_locally(corpus, s3_server, tmp_path):
    """Parquet row groups and zstd JSONL read through fsspec's S3 (ranged reads of footers and
    heads at planning): the same documents, hence the same shards, as from local copies."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    local = tmp_path / "local"
    local.mkdir()
    texts = [(corpus / name).read_text() for name in ("textwrap.py", "bisect.py", "fnmatch.py")]
    pq.write_table(pa.table({"text": texts}), local / "books.parquet", row_group_size=1)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[::-1])
    (local / "web.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    for path in local.iterdir():
        storage.put_file(str(path), storage.join_url(s3_server, "mixed", path.name))
    remote = shard_corpus(data_config([s3_server + "/mixed/*"], s3_server + "/mixed-shards"), SEQ_LEN, VOCAB)
    here = shard_corpus(data_config([str(local)], str(tmp_path / "shards")), SEQ_LEN, VOCAB)
    assert [f["kind"] for f in remote.inputs["files"]] == ["parquet", "jsonl"]
    np.testing.assert_array_equal(np.concatenate(all_windows(remote)), np.concatenate(all_windows(here)))
