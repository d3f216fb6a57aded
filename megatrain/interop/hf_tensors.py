"""A transformers folder's tensors, checked by their Hugging Face names before a byte of them is read.

The weights are ``model.safetensors``, or shards listed in ``model.safetensors.index.json``
(``weight_map``: tensor name -> file); pickle (``pytorch_model.bin``) is never loaded. A
safetensors file starts with an 8-byte little-endian length and a JSON header giving each
tensor's dtype, shape and byte range: ``read_headers`` reads only that, so checking a model of
many gigabytes costs a few kilobytes of reading, and a truncated file is found by its byte
ranges, before any run starts.

``check_tensors`` compares what the folder holds with what its config.json makes the model hold
(``expected_tensors``: a megatrain model of that config built on the meta device and mapped to
Hugging Face names by the family's table), name by name: a tensor missing, of another shape, not
floating point, or one the architecture does not have is named, with its shape and the expected
one. What transformers itself drops on loading is not a problem: a family's derived buffers
(``Family.ignored_tensors``) and a saved ``lm_head.weight`` when the embeddings are tied (the head
is the embedding matrix). A folder saved from the base model alone (``GPT2Model``, whose names
lack ``transformer.``) has its names read with the base prefix, as transformers does.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain import storage
from megatrain.config import ModelConfig
from megatrain.interop.mapping import Family, ImportMismatch

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' spelling: F32, BF16, I8, ...
    shape: tuple[int, ...]
    file: str  # the safetensors file holding it
    stored_name: str  # its name in that file (without the base prefix, for a base model saved alone)


def _header(path: str) -> dict[str, TensorInfo]:
    """The tensors a safetensors file says it holds, each byte range checked against the file's size."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ImportMismatch(f"{path}: not a safetensors file, or truncated (header length {length}, "
                                 f"file of {size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ImportMismatch(f"{path}: not a safetensors file (its header is not JSON)") from None
    data_bytes = size - 8 - length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ImportMismatch(f"{path}: not a safetensors file (entry {name!r} of its header is malformed)") from None
        if not 0 <= begin <= end <= data_bytes:
            raise ImportMismatch(f"{path}: truncated: {name} lies at bytes {begin}..{end} of the data, the file holds "
                                 f"{data_bytes}")
        out[name] = TensorInfo(dtype, shape, path, name)
    return out


def _index_files(hf_dir: Path, index: Path) -> dict[str, str]:
    """tensor name -> shard path, from a safetensors index; every shard name kept inside the folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = list(weight_map.items())
    except json.JSONDecodeError as exc:
        raise ImportMismatch(f"{index}: not valid JSON (JSON decode error: {exc.msg} at line {exc.lineno})") from None
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ImportMismatch(f"{index}: not a safetensors index (no weight_map: {type(exc).__name__})") from None
    shards = {}
    for file in sorted({file for _, file in items}, key=str):
        shards[file] = storage.confined(str(hf_dir), file, str(index))  # a name read from metadata never leaves its folder
        if not Path(shards[file]).is_file():
            raise ImportMismatch(f"{index}: lists {file}, which is not in {hf_dir}")
    return {name: shards[file] for name, file in items}


def read_headers(hf_dir: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a transformers folder (one model.safetensors or an indexed set of shards),
    from the files' headers only."""
    hf_dir = Path(hf_dir)
    single = hf_dir / SAFETENSORS_NAME
    if single.is_file():
        return _header(str(single))
    index = hf_dir / INDEX_NAME
    if not index.is_file():
        raise ImportMismatch(f"{hf_dir}: no {SAFETENSORS_NAME} or {INDEX_NAME} (safetensors only: a pytorch_model.bin "
                             "is pickle, which megatrain never loads)")
    listed = _index_files(hf_dir, index)
    found: dict[str, TensorInfo] = {}
    for path in sorted(set(listed.values())):
        for name, info in _header(path).items():
            if name in found:
                raise ImportMismatch(f"{index}: {name} is in both {found[name].file} and {path}")
            found[name] = info
    for name, path in listed.items():
        if name not in found or found[name].file != path:
            raise ImportMismatch(f"{index}: maps {name} to {path}, which does not hold it")
    return found


def expected_tensors(family: Family, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor ``family``'s architecture has for ``cfg``."""
    from megatrain.model import GPT

    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = GPT(cfg)
    return {name: tuple(t.shape) for name, t in family.to_hf(model.state_dict(), cfg).items()}


def _named_as_transformers_loads(found: dict[str, TensorInfo], family: Family) -> dict[str, TensorInfo]:
    """The base model saved alone has no head and no base prefix: read its names with the prefix."""
    prefix = family.base_prefix
    if prefix and found and not any(n.startswith((prefix, "lm_head.")) for n in found):
        return {prefix + name: info for name, info in found.items()}
    return found


def _dropped_by_transformers(name: str, family: Family, cfg: ModelConfig) -> bool:
    if cfg.tie_embeddings and name == "lm_head.weight":
        return True  # tied: transformers makes the head the embedding matrix, whatever was saved
    return any(re.search(pattern, name) for pattern in family.ignored_tensors)


def check_tensors(hf_dir: str | Path, family: Family, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """The tensors megatrain will read (Hugging Face name -> where), after checking each name,
    shape and dtype against ``cfg`` (the model config.json describes); else one ImportMismatch line
    naming the first problem's tensor, its shape and the expected one, and how many more there are."""
    found = _named_as_transformers_loads(read_headers(hf_dir), family)
    expected = expected_tensors(family, cfg)
    problems: list[tuple[str, str]] = []  # (tensor, what is wrong)
    for name, shape in expected.items():
        info = found.get(name)
        if info is None:
            problems.append((name, f"is missing (config.json makes it {list(shape)})"))
        elif info.shape != shape:
            problems.append((name, f"is {list(info.shape)} in {Path(info.file).name}, config.json makes it {list(shape)}"))
        elif info.dtype not in FLOAT_DTYPES:
            why = "megatrain imports floating-point weights (a quantized checkpoint is refused)"
            problems.append((name, f"has dtype {info.dtype}: {why}"))
    for name in found:
        if name not in expected and not _dropped_by_transformers(name, family, cfg):
            problems.append((name, f"is unexpected: {family.architecture} with this config.json has no such tensor"))
    if problems:
        (name, what), rest = problems[0], problems[1:]
        more = f" (and {len(rest)} more: {', '.join(n for n, _ in rest[:3])}{', ...' if len(rest) > 3 else ''})" if rest else ""
        raise ImportMismatch(f"{hf_dir}: {name} {what}{more}")
    return {name: found[name] for name in expected}


def read_tensors(tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """The tensors ``check_tensors`` returned, read from their files (only those: no derived buffer)."""
    from safetensors import safe_open

    out = {}
    by_file: dict[str, list[str]] = {}
    for name, info in tensors.items():
        by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            out.update((name, f.get_tensor(tensors[name].stored_name)) for name in names)
    return out


def read_hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers folder under its stored name (unchecked: see check_tensors)."""
    return read_tensors(read_headers(hf_dir))
