"""megatrain.storage on local paths, file:// and memory://, plus URL -> filesystem resolution.

Remote protocols (S3 on a real moto server, WebHDFS on a protocol stand-in) are exercised end to
end in tests/megatrain/data/test_remote_storage.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatrain import storage


@pytest.fixture(params=["plain", "file", "memory"])
def base(request, tmp_path: Path) -> Iterator[str]:
    if request.param == "plain":
        yield str(tmp_path)
        return
    if request.param == "file":
        yield f"file://{tmp_path}"
        return
    root = f"memory://storage-test-{uuid.uuid4().hex}"
    yield root
    if storage.exists(root):
        storage.rm(root, recursive=True)


def test_write_read_list_remove(base):
    url = storage.join_url(base, "a", "b", "c.bin")
    storage.write_bytes(url, b"payload")  # parent directories appear as needed
    assert storage.exists(url) and storage.read_bytes(url) == b"payload" and storage.size(url) == 7
    with storage.open_url(url) as handle:
        assert handle.read(3) == b"pay"
    with storage.open_url(storage.join_url(base, "a", "b", "d.txt"), "wb") as handle:
        handle.write(b"text")
    assert storage.list(storage.join_url(base, "a", "b")) == [storage.join_url(base, "a", "b", n) for n in ("c.bin", "d.txt")]
    assert sorted(storage.find(storage.join_url(base, "a"))) == storage.list(storage.join_url(base, "a", "b"))
    assert list(storage.glob(storage.join_url(base, "a", "*", "*.txt"))) == [storage.join_url(base, "a", "b", "d.txt")]
    storage.rm(url)
    assert not storage.exists(url)
    storage.rm(storage.join_url(base, "a"), recursive=True)
    assert not storage.exists(storage.join_url(base, "a", "b", "d.txt"))


def test_atomic_write_publishes_whole_files_only(base):
    url = storage.join_url(base, "index.json")
    storage.write_bytes(url, b"old")
    with pytest.raises(RuntimeError, match="crash"):
        with storage.atomic_write(url) as handle:
            handle.write(b"half of the new")
            raise RuntimeError("crash while writing")
    assert storage.read_bytes(url) == b"old"
    assert storage.list(base) == [url]  # the temporary file is gone too
    with storage.atomic_write(url) as handle:
        handle.write(b"new")
    assert storage.read_bytes(url) == b"new" and storage.list(base) == [url]


def test_put_file(base, tmp_path):
    local = tmp_path / "src.bin"
    local.write_bytes(bytes(range(256)) * 1000)
    url = storage.join_url(base, "up", "dst.bin")
    storage.put_file(str(local), url)
    assert storage.read_bytes(url) == local.read_bytes()


def test_errors_name_the_url(tmp_path):
    missing = str(tmp_path / "no" / "such.file")
    with pytest.raises(storage.StorageError, match=f"^{missing}: not found"):
        storage.read_bytes(missing)
    with pytest.raises(storage.StorageError, match=f"{missing}: not found"):
        storage.open_url(missing)
    with pytest.raises(storage.StorageError, match="nosuchproto://x/y: "):
        storage.exists("nosuchproto://x/y")
    assert isinstance(storage.StorageError("u", "r"), OSError)


def test_join_and_parent_url():
    assert storage.join_url("s3://bucket/runs/", "v1", "/index.json") == "s3://bucket/runs/v1/index.json"
    assert storage.join_url("/data", "shards") == "/data/shards"
    assert storage.join_url("relative", "x", "") == "relative/x"
    assert storage.join_url("/", "etc") == "/etc"
    assert storage.parent_url("webhdfs://nn:9870/a/b/c.tar") == "webhdfs://nn:9870/a/b"


def test_hdfs_urls_resolve_to_webhdfs_with_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_HDFS_USER", "alice")
    monkeypatch.setenv("MEGATRAIN_WEBHDFS_PORT", "50070")
    fs, path = storage.resolve("hdfs://namenode.internal/data/shards")
    assert (type(fs).__name__, fs.url, path) == ("WebHDFS", "http://namenode.internal:50070/webhdfs/v1", "/data/shards")
    assert fs.pars["user.name"] == "alice"
    fs, _ = storage.resolve("hdfs://bob@namenode.internal:9871/x")  # the URL's user and port win
    assert fs.url == "http://namenode.internal:9871/webhdfs/v1" and fs.pars["user.name"] == "bob"
    monkeypatch.setenv("MEGATRAIN_HDFS_NAMENODE", "nn2:14000")
    monkeypatch.setenv("MEGATRAIN_WEBHDFS_HTTPS", "1")
    fs, path = storage.resolve("hdfs:///user/runs")
    assert (fs.url, path) == ("https://nn2:14000/webhdfs/v1", "/user/runs")
    monkeypatch.delenv("MEGATRAIN_HDFS_NAMENODE")
    with pytest.raises(storage.StorageError, match="hdfs:///user/runs: .*MEGATRAIN_HDFS_NAMENODE"):
        storage.resolve("hdfs:///user/runs")


def test_s3_endpoint_comes_from_the_environment(monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("MEGATRAIN_S3_ENDPOINT", "http://127.0.0.1:9")
    fs, path = storage.resolve("s3://bucket/key/part")
    assert path == "bucket/key/part"
    assert fs.endpoint_url == "http://127.0.0.1:9"
    assert fs.storage_options["use_listings_cache"] is False  # other processes' writes stay visible
