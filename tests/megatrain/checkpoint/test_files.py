"""The streaming safetensors writer produces standard files; checksums catch damage."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint.files import ChecksumError, check_bytes, parse_step, step_dir_name, write_safetensors


def test_writer_output_is_read_by_safetensors(tmp_path):
    tensors = {
        "w": torch.randn(5, 3),
        "half": torch.randn(7).to(torch.bfloat16),
        "step": torch.tensor(3.0),
        "rng": torch.randint(0, 255, (11,), dtype=torch.uint8),
        "ids": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0, 2),
    }
    path = tmp_path / "x.safetensors"
    record = write_safetensors(path, tensors, {"note": "hi"})
    data = path.read_bytes()
    assert record.size == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_check_bytes_names_the_damage(damage):
    data = bytes(range(200))
    record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    check_bytes(data, record, "f.bin")
    bad = data[:-10] if damage == "truncate" else data[:50] + bytes([data[50] ^ 1]) + data[51:]
    with pytest.raises(ChecksumError, match="f.bin: " + ("size" if damage == "truncate" else "sha256")):
        check_bytes(bad, record, "f.bin")


def test_step_names():
    assert step_dir_name(100) == "step-00000100"
    assert parse_step("s3://b/run/step-00000100/") == 100
    assert parse_step(".step-00000100.tmp") is None and parse_step("manifest.json") is None
