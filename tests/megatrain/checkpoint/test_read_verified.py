"""The restore path's safetensors reader (files.read_safetensors_verified): one buffer, hashed while
read, tensors as views; the same tensors as safetensors' own parser, and every corruption refused."""

from __future__ import annotations

import pytest
import torch

from megatrain.checkpoint.files import (
    ChecksumError,
    UnreadableFile,
    parse_safetensors,
    read_safetensors_verified,
    write_safetensors,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(33, 7, generator=g), "step": torch.tensor(5, dtype=torch.int64),
            "half": torch.randn(13, generator=g).bfloat16(), "empty": torch.zeros(0, 4),
            "flags": torch.tensor([True, False, True]), "bytes": torch.arange(5, dtype=torch.uint8)}


def test_reads_what_safetensors_reads_bit_exact(tmp_path):
    path = tmp_path / "rank-00000.safetensors"
    record = write_safetensors(path, _tensors(), {"k": "v"})
    got = read_safetensors_verified(str(path), record.to_json(), path.name)
    reference = parse_safetensors(path.read_bytes(), path.name)
    assert set(got) == set(reference) == set(_tensors())
    for name, tensor in reference.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor) and torch.equal(got[name], _tensors()[name]), name
    # views into one buffer, not a copy per tensor
    assert got["w"].untyped_storage().data_ptr() == got["half"].untyped_storage().data_ptr()


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_corrupt_file_is_refused_naming_it(tmp_path, damage):
    path = tmp_path / "model-pp00-tp00.safetensors"
    record = write_safetensors(path, _tensors())
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-2] ^= 0x10
    path.write_bytes(data[:-1] if damage == "truncate" else data + b"\0" if damage == "append" else data)
    with pytest.raises(ChecksumError, match="model-pp00-tp00.safetensors: (sha256|size)"):
        read_safetensors_verified(str(path), record, path.name)


def test_header_lying_about_a_size_is_unreadable(tmp_path):
    """A manifest forged along with its file still must not yield a tensor of another size."""
    import hashlib
    import json
    import struct

    header = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 8
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(UnreadableFile, match="x.safetensors: safetensors entry 'x'"):
        read_safetensors_verified(str(path), record, path.name)
