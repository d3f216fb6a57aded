"""Shared fixtures of the data tests: a small real corpus, its shards, and real servers.

Everything here is real: files on disk, BPE training, tar shards, an S3-compatible server
(moto) and a WebHDFS protocol stand-in (see webhdfs_standin.py: not HDFS, its REST protocol).
The corpus is small (~50 KB) and the vocabulary 512, so sharding takes about a second.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from data_helpers import SEQ_LEN, VOCAB, data_config, make_corpus

from megatrain import storage
from megatrain.data.index import ShardIndex
from megatrain.data.shard import load_index, shard_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def small_index(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> ShardIndex:
    """The corpus sharded once for the session (tests must not modify these files)."""
    return shard_corpus(data_config([str(corpus)], str(tmp_path_factory.mktemp("shards"))), SEQ_LEN, VOCAB)


@pytest.fixture
def index_copy(small_index: ShardIndex, tmp_path: Path) -> ShardIndex:
    """A private copy of the session's shards, for tests that damage files."""
    target = tmp_path / small_index.version
    shutil.copytree(small_index.url, target)
    return load_index(str(target))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3-compatible server (moto) on loopback; yields a bucket URL, with the S3 endpoint
    and test credentials in the environment the way a deployment would set them."""
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if binary is None:
        pytest.skip("moto[server] is not installed (pip install 'moto[server]==5.2.5')")
    port = _free_port()
    process = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.1)
    env = {"MEGATRAIN_S3_ENDPOINT": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fs, _ = storage.resolve("s3://megatrain-test")
        fs.mkdir("megatrain-test")
        yield "s3://megatrain-test"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        process.terminate()
        process.wait(10)


@pytest.fixture
def webhdfs(tmp_path: Path) -> Iterator[object]:
    """The WebHDFS protocol stand-in over a fresh directory (a stand-in, not HDFS)."""
    from webhdfs_standin import WebHDFSStandIn

    (tmp_path / "hdfs-root").mkdir()
    with WebHDFSStandIn(tmp_path / "hdfs-root") as server:
        yield server
