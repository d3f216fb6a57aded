"""The storage probe (``megatrain/storage/probe.py``) against real filesystems: a local dir, a
read-only tmpfs (EROFS), tmpfs mounts too small for what they must hold, an S3 bucket on a moto
server, and endpoints where nothing listens. Not writable and too small are deterministic, one
line naming the location and the bytes; an outage stays a retriable StorageError. No case
leaves a file behind.

The tmpfs cases mount real filesystems: they need root (this project's sandboxes and CI run the
tests as root) and skip otherwise."""

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

from megatrain import storage
from megatrain.errors import DeterministicError
from megatrain.storage import probe as probe_module
from megatrain.storage.probe import (
    PROBE_PREFIX,
    LocationNotWritable,
    LocationTooSmall,
    Target,
)

MIB = 2**20


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_a_writable_local_dir_passes_and_keeps_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "kept.txt").write_text("the run's own file")
    result = storage.probe_location(str(tmp_path / "run"))
    assert result.nbytes == 4096 and result.free is not None and result.free > 0
    assert files_under(tmp_path) == [tmp_path / "run" / "kept.txt"]

    # a location that does not exist yet is created for the write, then removed again
    deep = tmp_path / "run" / "not" / "yet"
    storage.probe_location(storage.Target(str(deep), "checkpoint.staging_dir", needed=MIB, what="1 MiB"))
    assert not (tmp_path / "run" / "not").exists()
    storage.probe_location(f"file://{tmp_path}/run")  # file:// URLs too
    assert files_under(tmp_path) == [tmp_path / "run" / "kept.txt"]


def test_a_read_only_filesystem_is_deterministic_and_named(tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "ro", 4 * MIB, read_only=True) as disk:
        target = Target(str(disk / "ckpt"), "checkpoint.durable_url", needed=2 * MIB, what="two checkpoints (2 x 1 MiB)")
        with pytest.raises(LocationNotWritable) as failed:
            storage.probe_locations([target])
        message = str(failed.value)
        assert isinstance(failed.value, DeterministicError) and "\n" not in message
        assert message.startswith(f"checkpoint.durable_url {disk}/ckpt is not writable: ")
        assert "Read-only file system" in message
        assert f"{2 * MIB} bytes (2.0 MiB)" in message and f"{4 * MIB} bytes (4.0 MiB) free" in message
        assert files_under(disk) == []


def test_a_filesystem_too_small_for_two_checkpoints_names_the_numbers(tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "small", MIB) as disk:
        target = Target(str(disk / "ckpt"), "checkpoint.durable_url", needed=3 * MIB,
                        what=f"two checkpoints (2 x {3 * MIB // 2} bytes)")
        with pytest.raises(LocationTooSmall) as failed:
            storage.probe_locations([target])
        assert str(failed.value) == (
            f"checkpoint.durable_url {disk}/ckpt: too small for two checkpoints (2 x {3 * MIB // 2} bytes): "
            f"needs {3 * MIB} bytes (3.0 MiB), {MIB} bytes (1.0 MiB) free")
        assert isinstance(failed.value, DeterministicError) and storage.is_no_space(failed.value)
        assert (failed.value.needed, failed.value.free) == (3 * MIB, MIB)
        assert files_under(disk) == [] and list(disk.iterdir()) == []  # not even the directory

        # two locations on one filesystem must fit together: each alone would
        both = [Target(str(disk / "staging"), "checkpoint.staging_dir", needed=MIB // 2 + 1, what="a"),
                Target(str(disk / "durable"), "checkpoint.durable_url", needed=MIB // 2, what="b")]
        storage.probe_locations(both[:1])
        with pytest.raises(LocationTooSmall, match=rf"checkpoint.staging_dir {disk}/staging and checkpoint.durable_url "
                                                   rf"{disk}/durable \(one filesystem\): too small for a \+ b: "
                                                   rf"needs {MIB + 1} bytes"):
            storage.probe_locations(both)
        assert list(disk.iterdir()) == []


def test_a_failure_after_the_write_still_removes_the_probe_file(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_module, "read_bytes", lambda url: b"something else")
    with pytest.raises(LocationNotWritable, match="read back 14 bytes that differ from the 4096 written"):
        storage.probe_location(Target(str(tmp_path), "train.run_dir"))
    assert files_under(tmp_path) == []

    def outage(url):
        raise storage.StorageError(url, "ConnectionError: the server went away")

    monkeypatch.setattr(probe_module, "read_bytes", outage)
    with pytest.raises(storage.StorageError, match="the server went away") as failed:
        storage.probe_location(str(tmp_path))
    assert not isinstance(failed.value, DeterministicError)
    assert files_under(tmp_path) == []


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """A real S3-compatible server (moto) on loopback, started as tests/megatrain/data/conftest.py
    does; yields a bucket URL, with the endpoint and test credentials in the environment."""
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if binary is None:
        pytest.skip("moto[server] is not installed (pip install 'moto[server]==5.2.5')")
    port = closed_port()
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
        fs, _ = storage.resolve("s3://probe-test")
        fs.mkdir("probe-test")
        yield "s3://probe-test"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        process.terminate()
        process.wait(10)


def test_an_s3_bucket_on_moto(s3_bucket):
    storage.write_bytes(f"{s3_bucket}/ckpt/step-00000002/manifest.json", b"{}")
    result = storage.probe_locations([Target(f"{s3_bucket}/ckpt", "checkpoint.durable_url", needed=10**15, what="x")])[0]
    assert result.free is None  # an object store has no "free": no size check, however large the need
    assert list(storage.find(s3_bucket)) == [f"{s3_bucket}/ckpt/step-00000002/manifest.json"]

    # a bucket that does not exist never will by retrying: deterministic, named
    with pytest.raises(LocationNotWritable, match=r"^checkpoint.durable_url s3://no-such-bucket/ckpt is not "
                                                  r"writable: FileNotFoundError"):
        storage.probe_location(Target("s3://no-such-bucket/ckpt", "checkpoint.durable_url"))
    assert not any(PROBE_PREFIX in url for url in storage.find(s3_bucket))


@pytest.mark.parametrize("scheme", ["s3", "webhdfs"])
def test_an_unreachable_store_is_an_outage_not_a_verdict(scheme, monkeypatch):
    """Connection refused may end: a StorageError naming the URL, which the caller's retries
    (a task's, the launcher's restart) still apply to."""
    port = closed_port()
    if scheme == "s3":
        monkeypatch.setenv("MEGATRAIN_S3_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries would take ~10 s
        url = "s3://bucket/ckpt"
    else:
        url = f"webhdfs://127.0.0.1:{port}/ckpt"
    with pytest.raises(storage.StorageError) as failed:
        storage.probe_location(Target(url, "checkpoint.durable_url"))
    assert not isinstance(failed.value, DeterministicError)
    assert str(failed.value).startswith(f"{url}/{PROBE_PREFIX}") and "onnect" in str(failed.value)


def test_a_directory_removed_by_a_concurrent_probe_just_before_the_open_is_made_again(tmp_path, monkeypatch):
    """Two campaigns under one new root each probe their own run dir: one probe's clean-up may
    remove the shared, momentarily empty parent after the other made it and before it opens its
    file (seen once in make test: campaign b's 'run_dir is not writable: FileNotFoundError'). The
    removal is done for real here, at that moment, once; the write makes the directories again."""
    from fsspec.implementations import local

    opener = local.LocalFileOpener.__init__
    removed = []

    def remove_parent_first(self, path, mode, *args, **kwargs):
        if "w" in mode and not removed:  # the other process's os.rmdir lands now
            parent = os.path.dirname(path)
            os.rmdir(parent)
            os.rmdir(os.path.dirname(parent))
            removed.append(parent)
        return opener(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(local.LocalFileOpener, "__init__", remove_parent_first)
    run_dir = tmp_path / "campaigns" / "b" / "only"
    result = storage.probe_location(str(run_dir))
    assert removed == [str(run_dir)] and result.nbytes == 4096
    assert not (tmp_path / "campaigns").exists()  # the probe still removed what it made
