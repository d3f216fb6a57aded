"""The on-disk format of a checkpoint: file names, a streaming safetensors writer, checksums.

One step is one directory, ``step-00000100/``, the same in the local staging dir and in durable
storage::

    model-pp00-tp00.safetensors   model weights of one (pipeline, tensor) shard, written by its dp_rank 0
                                  (under expert parallelism: all but the routed experts)
    model-pp00-tp00-ep01.safetensors  expert parallelism only: EP rank 1's slice of the routed experts,
                                  written by dp_rank 1 (checkpoint/experts.py)
    rank-00003.safetensors        rank 3's optimizer partition (ZeRO) and RNG tensors
    rank-00003.json               rank 3's non-tensor state: step, LR schedule, data position, RNG, counters
    rank-00003.done.json          rank 3's marker, written last: its files with size and sha256
    manifest.json                 durable only, written last of all: the commit (see upload.py)
    staged.json                   staging only, "external" upload mode: every rank has staged
    replacing.json                durable only, while a corrupt committed copy is replaced (upload.py)

Tensors go into safetensors files and everything else into JSON, so loading a checkpoint never
runs code (no pickle). The writer below streams each tensor's bytes straight from its (pinned)
host buffer to the file and into sha256 in the same pass: safetensors' own ``save_file`` first
serialises the whole file into memory, which would double the host memory of a 20 GB state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain import storage

MANIFEST = "manifest.json"
STAGED = "staged.json"
REPLACING = "replacing.json"  # durable only: a corrupt committed copy of this step is being replaced
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_CHUNK = 64 << 20  # write and hash 64 MiB slices, so hashing one slice overlaps writing it


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """``step-00000100`` -> 100; anything else (temporary files, markers) -> None."""
    match = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def model_file(pp_rank: int, tp_rank: int, ep_rank: int | None = None) -> str:
    """A (pp, tp) shard's weights; with ``ep_rank``, that EP rank's slice of the routed experts."""
    ep = "" if ep_rank is None else f"-ep{ep_rank:02d}"
    return f"model-pp{pp_rank:02d}-tp{tp_rank:02d}{ep}.safetensors"


def rank_tensor_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_meta_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_marker(rank: int) -> str:
    return f"rank-{rank:05d}.done.json"


@dataclass(frozen=True)
class FileRecord:
    """What a manifest knows about one file: enough to detect truncation and bit flips."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ChecksumError(RuntimeError):
    """A file's size or sha256 differs from its record; the message names the file."""


# torch dtype -> safetensors dtype name, widest first (the writer orders tensors by this so every
# tensor starts at an offset aligned to its element size, as safetensors' own writer does).
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
    torch.float32: "F32", torch.int32: "I32", torch.uint32: "U32",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int16: "I16", torch.uint16: "U16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (numpy has no bf16, so view as uint8)."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FileRecord:
    """Write CPU tensors as a standard safetensors file, hashing while writing."""
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{path}: tensor {name} must be contiguous on the CPU")
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    # Hash each chunk in a helper thread while this one writes it: both release the GIL, so the
    # file costs max(write, hash) rather than their sum.
    with open(path, "wb") as out, ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        pieces = [memoryview(struct.pack("<Q", len(blob))), memoryview(blob)]
        pieces += [data[i:i + _CHUNK] for data in (_raw_bytes(tensors[n]) for n in names) for i in range(0, len(data), _CHUNK)]
        for piece in pieces:
            hashed = hasher.submit(digest.update, piece)
            out.write(piece)
            hashed.result()
    return FileRecord(size=8 + len(blob) + offset, sha256=digest.hexdigest())


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors from the bytes of a safetensors file (data only: nothing is executed)."""
    from safetensors.torch import load

    return load(data)


class UnreadableFile(ChecksumError):
    """A checkpoint file that does not parse (bad JSON, bad safetensors header): as corrupt as a
    flipped bit, whatever its checksum says (a manifest can be forged along with its file)."""


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def check_safetensors_header(head: bytes, size: int, name: str) -> None:
    """Raise UnreadableFile unless ``head`` (the first bytes of a ``size``-byte file, at least the
    8-byte length and the header) is a safetensors header whose tensors lie inside the file."""
    if size < 8 or len(head) < 8:
        raise UnreadableFile(f"{name}: {size} bytes, too short for a safetensors file")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(_MAX_HEADER, size - 8) or len(head) < 8 + length:
        raise UnreadableFile(f"{name}: safetensors header length {length} does not fit a {size}-byte file")
    try:
        header = json.loads(head[8:8 + length])
    except ValueError as exc:
        raise UnreadableFile(f"{name}: safetensors header is not JSON ({exc})") from None
    data_bytes = size - 8 - length
    dtypes = set(_DTYPES.values())
    if not isinstance(header, dict):
        raise UnreadableFile(f"{name}: safetensors header is not a mapping")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
            ok = entry["dtype"] in dtypes and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            ok = ok and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_bytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise UnreadableFile(f"{name}: safetensors entry {key!r} is malformed or lies outside the file: {entry!r}")


def parse_safetensors(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """``load_safetensors`` for bytes read from storage: a malformed file raises UnreadableFile
    (the header is checked first: the Rust parser may panic, which is no Exception)."""
    check_safetensors_header(data[:8 + min(_MAX_HEADER, max(len(data) - 8, 0))], len(data), name)
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors' own checks: sizes that do not match dtype x shape
        raise UnreadableFile(f"{name}: not a valid safetensors file ({exc})") from None


def parse_json(data: bytes, name: str) -> Any:
    """JSON from bytes read from storage; bad JSON or UTF-8 raises UnreadableFile."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise UnreadableFile(f"{name}: not valid JSON ({exc})") from None


def check_parses(url: str, name: str) -> None:
    """Raise UnreadableFile unless the file at ``url`` parses as what its name says (JSON; or a
    safetensors header, read without the tensors)."""
    if name.endswith(".json"):
        parse_json(storage.read_bytes(url), url)
    elif name.endswith(".safetensors"):
        size = storage.size(url)
        with storage.open_url(url) as handle:
            head = handle.read(8)
            if len(head) == 8:
                head += handle.read(min(struct.unpack("<Q", head)[0], _MAX_HEADER, size - 8))
        check_safetensors_header(head, size, url)


def write_json(path: Path, value: Any) -> FileRecord:
    """Write JSON through a temporary name and a rename, so a reader never sees half a file."""
    data = json.dumps(value, indent=1, sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return FileRecord(size=len(data), sha256=hashlib.sha256(data).hexdigest())


def check_bytes(data: bytes, record: FileRecord | dict[str, Any], name: str) -> None:
    """Raise ChecksumError naming ``name`` when ``data`` is not the recorded file."""
    expected = record if isinstance(record, FileRecord) else FileRecord(**record)
    if len(data) != expected.size:
        raise ChecksumError(f"{name}: size {len(data)} != recorded {expected.size} (truncated or overwritten)")
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected.sha256:
        raise ChecksumError(f"{name}: sha256 {actual[:16]}... != recorded {expected.sha256[:16]}... (corrupted)")


def sha256_stream(handle: Any) -> FileRecord:
    """Size and sha256 of a readable binary file object, read in chunks."""
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return FileRecord(size=size, sha256=digest.hexdigest())


_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def read_safetensors_verified(url: str, record: FileRecord | dict[str, Any], name: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors file, after checking its size and sha256: the
    restore path's reader. One copy from storage into one host buffer, hashed slice by slice in a
    helper thread while the next slice is read (the file costs max(read, hash), not their sum),
    and the tensors are views into that buffer (``parse_safetensors`` over ``read_bytes`` made two
    more copies of the whole file: bytes, then safetensors' own tensors)."""
    expected = record if isinstance(record, FileRecord) else FileRecord(**record)
    buffer = torch.empty(expected.size, dtype=torch.uint8)
    view = memoryview(buffer.numpy()) if expected.size else memoryview(bytearray())
    digest, filled = hashlib.sha256(), 0
    with storage.open_url(url) as handle, ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as hasher:
        hashed = None
        while filled < expected.size:
            got = _read_into(handle, view[filled:filled + _CHUNK])
            if not got:
                break
            if hashed is not None:
                hashed.result()
            hashed = hasher.submit(digest.update, view[filled:filled + got])
            filled += got
        extra = handle.read(1)  # a file longer than its record is as wrong as a shorter one
        if hashed is not None:
            hashed.result()
    if filled != expected.size or extra:
        size = f"more than {expected.size}" if extra else str(filled)
        raise ChecksumError(f"{name}: size {size} != recorded {expected.size} (truncated or overwritten)")
    actual = digest.hexdigest()
    if actual != expected.sha256:
        raise ChecksumError(f"{name}: sha256 {actual[:16]}... != recorded {expected.sha256[:16]}... (corrupted)")
    return tensor_views(buffer, name)


def _read_into(handle: Any, target: memoryview) -> int:
    """Fill ``target`` from ``handle`` as far as the file goes; bytes read (0 at its end)."""
    if hasattr(handle, "readinto"):
        return handle.readinto(target) or 0
    data = handle.read(len(target))
    target[:len(data)] = data
    return len(data)


def tensor_views(buffer: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buffer`` (uint8), as views into it (copied only
    where a tensor's offset is not a multiple of its element size, which safetensors' own writer and
    ours never produce). The same checks as ``parse_safetensors``; no code runs."""
    size = buffer.numel()
    head = bytes(memoryview(buffer[:8 + min(_MAX_HEADER, max(size - 8, 0))].numpy()))
    check_safetensors_header(head, size, name)
    (length,) = struct.unpack("<Q", head[:8])
    header = json.loads(head[8:8 + length])
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype, shape = _TORCH_DTYPES[entry["dtype"]], entry["shape"]
        start, end = (8 + length + offset for offset in entry["data_offsets"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for dim in shape:
            count *= dim
        if end - start != count * itemsize:
            raise UnreadableFile(f"{name}: safetensors entry {key!r} holds {end - start} bytes, "
                                 f"not {count} x {itemsize} ({entry['dtype']} {shape})")
        raw = buffer[start:end] if start % itemsize == 0 else buffer[start:end].clone()
        tensors[key] = raw.view(dtype).reshape(shape)
    return tensors
