"""Names read from metadata never leave their folder: ``storage.confined`` and every reader and
writer that takes a name from a manifest, a staged or durable rank marker, or a shard index.

Each hostile name is planted next to a *secret* file outside the folder, and the metadata records
the secret's real size and sha256: a reader that followed the name would find a perfect match and
answer "ok" (what ``megatrain checkpoints verify`` did before). Every case asserts the refusal,
the message (the name, the folder, the metadata file), that nothing outside the folder changed,
and that no secret byte came back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from megatrain import storage
from megatrain.checkpoint import catalog
from megatrain.checkpoint.cli import cli as checkpoints_cli
from megatrain.checkpoint.files import (
    MANIFEST, rank_marker, rank_meta_file, rank_tensor_file, step_dir_name, write_json, write_safetensors,
)
from megatrain.checkpoint.restore import read_verified, verify_checkpoint
from megatrain.checkpoint.retention import apply_retention, clean_staging
from megatrain.checkpoint.upload import commit_checkpoint, upload_checkpoint, upload_staged_step
from megatrain.data.index import INDEX_NAME, FORMAT, ShardIndex, ShardInfo, load_index
from megatrain.data.loader import build_loader
from megatrain.data.node_loader import build_node_loader
from megatrain.errors import DeterministicError, UnsafePathError

SECRET = b"outside the folder: must never be read, listed or overwritten\n" * 4
SYMLINK = object()  # planted as a symlink inside the folder that points at the secret
TO_SECRET = object()  # the relative path from the folder to the secret
ABS_SECRET = object()  # the secret's absolute path

HOSTILE = {
    "dotdot-etc": "../../etc/passwd",
    "absolute-etc": "/etc/passwd",
    "inner-dotdot": "a/../../b",
    "dotdot": "..",
    "dot": ".",
    "nul": "x\x00y",
    "newline": "model\n.safetensors",
    "sub-up": "sub/../../..",
    "backslash-drive": "C:\\x",
    "backslash-up": "..\\..\\secret.bin",
    "tilde": "~root",
    "one-dot-leaders": "\u2024\u2024/secret.bin",
    "fullwidth-dots": "\uff0e\uff0e\uff0fsecret.bin",
    "very-long": "a" * 5000,
    "empty": "",
    "double-slash": "sub//x",
    "relative-to-secret": TO_SECRET,
    "absolute-secret": ABS_SECRET,
    "symlink-out": SYMLINK,
}


@pytest.fixture(params=list(HOSTILE), ids=list(HOSTILE))
def hostile(request):
    return HOSTILE[request.param]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.bin"
    path.write_bytes(SECRET)
    return path


def plant(folder: Path, kind: object, secret: Path, link_name: str = "evil.bin") -> str:
    """The name a hostile metadata file would hold for ``folder``."""
    if kind is SYMLINK:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / link_name).symlink_to(secret)
        return link_name
    if kind is TO_SECRET:
        return os.path.relpath(secret, folder)
    if kind is ABS_SECRET:
        return str(secret)
    return str(kind)


def secret_record() -> dict:
    return {"size": len(SECRET), "sha256": hashlib.sha256(SECRET).hexdigest()}


def tree(root: Path, inside: Path | None = None) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root`` outside ``inside`` (path -> size, content hash): what must not change."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and (inside is None or inside not in path.parents):
            out[str(path)] = (path.stat().st_size, hashlib.sha256(path.read_bytes()).digest())
    return out


def assert_refused(exc: BaseException, name: str, folder: str, source: str) -> None:
    assert isinstance(exc, UnsafePathError) and isinstance(exc, DeterministicError)
    text = str(exc)
    assert "unsafe name" in text and folder in text and source in text, text
    assert repr(name)[:60] in text or "truncated" in text, text


# --------------------------------------------------------------------------- the resolver itself


def test_resolver_refuses_every_hostile_name(hostile, secret, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    name = plant(base, hostile, secret)
    with pytest.raises(UnsafePathError) as refused:
        storage.confined(str(base), name, "meta.json")
    assert_refused(refused.value, name, str(base), "meta.json")
    if hostile is not SYMLINK:  # the same on a remote URL (no filesystem to resolve symlinks on)
        with pytest.raises(UnsafePathError):
            storage.confined("s3://bucket/runs", name, "meta.json")


@pytest.mark.parametrize("name", ["model-pp00-tp00.safetensors", "rank-00003.json", "sub/shard-000001.tar",
                                  ".tmp-hidden", "a..b", "v1.2_x-y"])
def test_resolver_accepts_plain_names(name, tmp_path):
    assert storage.confined(str(tmp_path), name, "m.json") == f"{tmp_path}/{name}"
    assert storage.confined(f"file://{tmp_path}", name, "m.json") == f"file://{tmp_path}/{name}"
    assert storage.confined("memory://bucket/x", name, "m.json") == f"memory://bucket/x/{name}"


def test_a_symlink_that_stays_inside_is_fine(tmp_path):
    (tmp_path / "real.bin").write_bytes(b"x")
    (tmp_path / "alias.bin").symlink_to(tmp_path / "real.bin")
    assert storage.confined(str(tmp_path), "alias.bin", "m.json") == f"{tmp_path}/alias.bin"


# --------------------------------------------------------------------------- checkpoints


def committed_step(durable: Path, hostile: object, secret: Path, step: int = 2) -> tuple[Path, str, dict]:
    """A committed step whose manifest lists one good file and one hostile name (with the secret's
    real checksum). Returns (step dir, the hostile name, the manifest)."""
    step_dir = durable / step_dir_name(step)
    step_dir.mkdir(parents=True)
    good = write_safetensors(step_dir / rank_tensor_file(0), {"w": torch.arange(4, dtype=torch.float32)})
    name = plant(step_dir, hostile, secret)
    manifest = {"format": 1, "step": step, "layout": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1},
                "fingerprint": "f", "bytes": good.size + len(SECRET),
                "files": {"rank-00000": {rank_tensor_file(0): good.to_json(), name: secret_record()}}}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    return step_dir, name, manifest


def test_checkpoints_verify_refuses(hostile, secret, tmp_path, capsys):
    durable = tmp_path / "a" / "b" / "durable"
    step_dir, name, manifest = committed_step(durable, hostile, secret)
    before = tree(tmp_path)
    assert checkpoints_cli(["verify", str(durable)]) == 1
    out = capsys.readouterr().out
    assert "step 2: CORRUPT" in out and "unsafe name" in out and "ok" not in out.replace("look", ""), out
    problems = verify_checkpoint(str(step_dir), manifest)  # the function, given the manifest directly
    assert len(problems) == 1 and "unsafe name" in problems[0] and str(step_dir) in problems[0]
    assert tree(tmp_path) == before


def test_restore_and_catalog_refuse(hostile, secret, tmp_path):
    durable = tmp_path / "a" / "b" / "durable"
    step_dir, name, manifest = committed_step(durable, hostile, secret)
    with pytest.raises(UnsafePathError) as refused:
        read_verified(str(step_dir), name, manifest)
    assert_refused(refused.value, name, str(step_dir), f"{step_dir}/{MANIFEST}")
    (info,) = catalog.list_checkpoints(str(durable))
    assert not info.committed and "unsafe name" in info.problem  # restore skips it, to older steps
    assert catalog.committed(str(durable)) == []
    assert (tmp_path / "secret.bin").read_bytes() == SECRET


def staged_step(staging: Path, hostile: object, secret: Path, step: int = 2) -> tuple[Path, str]:
    """A staged step of rank 0 whose marker lists a hostile name (with the secret's checksum)."""
    step_dir = staging / step_dir_name(step)
    step_dir.mkdir(parents=True)
    good = write_json(step_dir / rank_meta_file(0), {"step": step, "rank": 0})
    name = plant(step_dir, hostile, secret)
    write_json(step_dir / rank_marker(0), {
        "step": step, "rank": 0, "fingerprint": "f", "coords": {"dp": 0, "tp": 0, "pp": 0},
        "layout": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1},
        "files": {rank_meta_file(0): good.to_json(), name: secret_record()}})
    return step_dir, name


@pytest.mark.parametrize("mode", ["external", "thread"])
def test_upload_refuses_a_staged_marker(hostile, secret, tmp_path, mode):
    staging, durable = tmp_path / "x" / "staging", tmp_path / "y" / "z" / "durable"
    step_dir, name = staged_step(staging, hostile, secret)
    before = tree(tmp_path)
    with pytest.raises(UnsafePathError) as refused:
        if mode == "external":  # the flow's upload task: every rank of a shared staging dir
            upload_staged_step(str(staging), str(durable), 2, retries=0)
        else:  # the trainer's upload thread: its own rank, and rank 0 commits
            upload_checkpoint(step_dir, str(durable), ranks=[0], commit=True, retries=0)
    assert_refused(refused.value, name, str(step_dir), str(step_dir / rank_marker(0)))
    assert tree(tmp_path) == before  # nothing read out to durable, nothing written anywhere
    assert not durable.exists() or catalog.committed(str(durable)) == []


def test_commit_refuses_a_durable_marker(hostile, secret, tmp_path):
    step_dir = tmp_path / "d" / "e" / "durable" / step_dir_name(2)
    step_dir.mkdir(parents=True)
    name = plant(step_dir, hostile, secret)
    marker = {"step": 2, "rank": 0, "fingerprint": "f", "coords": {"dp": 0, "tp": 0, "pp": 0},
              "layout": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1}, "files": {name: secret_record()}}
    (step_dir / rank_marker(0)).write_text(json.dumps(marker))
    with pytest.raises(UnsafePathError) as refused:
        commit_checkpoint(str(step_dir), world_size=1, timeout_s=5, poll_s=0.01, retries=0)
    assert_refused(refused.value, name, str(step_dir), str(step_dir / rank_marker(0)))
    assert not (step_dir / MANIFEST).exists()  # never committed


def test_retention_and_staging_cleanup_leave_symlinked_step_dirs_alone(secret, tmp_path):
    outside = tmp_path / "outside-step"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"precious")
    durable, staging = tmp_path / "durable", tmp_path / "staging"
    for step in (4, 6):  # two real committed steps, so retention would delete the oldest
        step_dir = durable / step_dir_name(step)
        step_dir.mkdir(parents=True)
        (step_dir / MANIFEST).write_text(json.dumps({"step": step, "files": {}, "bytes": 0}))
    (durable / step_dir_name(2)).symlink_to(outside)  # the oldest "step": a link out
    (outside / MANIFEST).write_text(json.dumps({"step": 2, "files": {}, "bytes": 0}))
    staging.mkdir()
    (staging / step_dir_name(4)).symlink_to(outside)  # "staged", and step 4 is committed

    infos = {info.step: info for info in catalog.list_checkpoints(str(durable))}
    assert not infos[2].committed and "unsafe name" in infos[2].problem
    assert apply_retention(str(durable), keep_last=1) == [4]  # the real old step goes, the link is not a step
    assert clean_staging(str(staging), str(durable)) == []
    assert (outside / "precious.bin").read_bytes() == b"precious" and (outside / MANIFEST).exists()


# --------------------------------------------------------------------------- data


def write_index(version: Path, shard_name: str, tokenizer: str = "tokenizer.json") -> None:
    raw = {"format": FORMAT, "version": "v1", "seq_len": 4, "vocab_size": 16, "eos_id": 0, "dtype": "uint16",
           "num_samples": 2, "num_tokens": 10, "tokenizer_file": tokenizer, "tokenizer_sha256": "0" * 64,
           "shards": [{"name": shard_name, "num_samples": 2, "sha256": hashlib.sha256(SECRET).hexdigest(),
                       "bytes": len(SECRET)}]}
    (version / INDEX_NAME).write_text(json.dumps(raw))


@pytest.mark.parametrize("field", ["shard", "tokenizer"])
def test_shard_index_refuses(hostile, secret, tmp_path, field):
    version = tmp_path / "shards" / "v1"
    version.mkdir(parents=True)
    name = plant(version, hostile, secret)
    write_index(version, name if field == "shard" else "shard-000000.tar",
                tokenizer=name if field == "tokenizer" else "tokenizer.json")
    with pytest.raises(UnsafePathError) as refused:
        load_index(str(version))
    assert_refused(refused.value, name, str(version), str(version / INDEX_NAME))


def hostile_index(version: Path, name: str) -> ShardIndex:
    """An index built in memory (as a caller bypassing load_index could): the loaders still refuse."""
    return ShardIndex(url=str(version), version="v1", seq_len=4, vocab_size=16, eos_id=0, dtype="uint16",
                      num_samples=2, num_tokens=10, tokenizer_file="tokenizer.json", tokenizer_sha256="0" * 64,
                      shards=[ShardInfo(name, 2, hashlib.sha256(SECRET).hexdigest(), len(SECRET))])


@pytest.mark.parametrize("loader", ["shard", "node"])
def test_loaders_refuse(hostile, secret, tmp_path, loader):
    version = tmp_path / "shards" / "v1"
    version.mkdir(parents=True)
    name = plant(version, hostile, secret)
    index = hostile_index(version, name)
    common = dict(micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, prefetch_batches=2, shuffle_shards=0)
    if loader == "shard":
        built = build_loader(index, **common)
    else:  # the node's reader (local rank 0), alone on its node
        built = build_node_loader(index, local_rank=0, local_world_size=1, channel=f"paths-{tmp_path.name}",
                                  timeout_s=10, **common)
    try:
        with pytest.raises(UnsafePathError) as refused:
            next(built)
    finally:
        built.close()
    assert_refused(refused.value, name, str(version), str(version / INDEX_NAME))


def test_hf_import_refuses_a_shard_name_in_the_safetensors_index(hostile, secret, tmp_path):
    """``checkpoint.init_from: hf:<dir>`` reads the shard names of ``model.safetensors.index.json``."""
    from megatrain.interop.hf import read_hf_tensors

    hf_dir = tmp_path / "hf"
    name = plant(hf_dir, hostile, secret)
    hf_dir.mkdir(exist_ok=True)
    index = hf_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": name}}))
    with pytest.raises(UnsafePathError) as refused:
        read_hf_tensors(hf_dir)
    assert_refused(refused.value, name, str(hf_dir), str(index))
