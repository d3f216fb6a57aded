"""Nothing is lost silently: a staging, upload or commit failure fails the training loop with a
clear error, a full disk is found before writing (path, bytes needed, bytes free) and leaves no
partial file, and a corrupt committed step is replaced (thread mode too), not kept.

Full disks are real: small tmpfs mounts (needs root, as in this project's sandboxes and CI).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import subprocess
from pathlib import Path

import pytest
import yaml

from megatrain import storage
from megatrain.config.campaign import load_campaign, stage_config
from megatrain.checkpoint import catalog
from megatrain.checkpoint.cli import cli as checkpoints_cli
from megatrain.checkpoint.files import MANIFEST, step_dir_name
from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import verify_checkpoint
from megatrain.checkpoint.upload import UploadError, upload_checkpoint
from megatrain.config import ConfigError

from checkpoint_fakes import assert_same_state, full_state, make_trainer, run

ROOT = Path(__file__).resolve().parents[3]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def test_a_full_staging_disk_fails_the_loop_before_writing(fresh, tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "disk", "16k") as disk:
        _, trainer, checkpointer = fresh(interval=1, staging_dir=disk / "staging")
        with pytest.raises(storage.NoSpaceError) as full:
            run(trainer, checkpointer, 3)  # step 1 stages in the background; step 2 learns it failed
        assert trainer.step == 2  # the very next step: no training on past a lost checkpoint
        text = str(full.value)
        assert str(disk / "staging" / step_dir_name(1)) in text and "staging step 1 (rank 0)" in text
        assert f"needs {full.value.needed} bytes, {full.value.free} bytes free" in text
        assert full.value.needed > full.value.free
        assert files_under(disk) == []  # nothing half-written


def test_a_disk_that_fills_while_staging_leaves_no_partial_file(fresh, tmp_path, mount_tmpfs, monkeypatch):
    with mount_tmpfs(tmp_path / "disk", "8k") as disk:
        monkeypatch.setattr(storage.space, "free_bytes", lambda url: 1 << 40)  # the check is fooled; the disk is not
        _, trainer, checkpointer = fresh(interval=1, staging_dir=disk / "staging")
        run(trainer, checkpointer, 1)
        with pytest.raises(storage.NoSpaceError, match=rf"{disk / 'staging'}.*needs \d+ bytes"):
            checkpointer.close()  # close raises it too (a save at the last step has no next step)
        assert files_under(disk) == []


def test_a_full_durable_disk_fails_the_loop_and_the_staged_step_survives(fresh, tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "disk", "16k") as disk:
        cfg, trainer, checkpointer = fresh(interval=1, durable_url=disk / "durable")
        run(trainer, checkpointer, 1)
        with pytest.raises(storage.NoSpaceError) as full:
            checkpointer.close()
        assert str(disk / "durable" / step_dir_name(1)) in str(full.value) and "rank 0's files of step 1" in str(full.value)
        assert files_under(disk) == []  # no partial upload, no commit
        staged = Path(cfg.checkpoint.staging_dir) / step_dir_name(1)
        assert staged.is_dir()  # still staged: nothing lost, the upload can be redone
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        upload_checkpoint(staged, str(disk / "durable"))
        (info,) = catalog.committed(str(disk / "durable"))
        assert info.step == 1 and verify_checkpoint(info.url, info.manifest) == []


def test_a_write_failing_mid_upload_leaves_no_temporary_file(fresh, tmp_path, mount_tmpfs, monkeypatch):
    with mount_tmpfs(tmp_path / "disk", "8k") as disk:
        monkeypatch.setattr(storage.space, "free_bytes", lambda url: 1 << 40)
        _, trainer, checkpointer = fresh(interval=1, durable_url=disk / "durable", upload_retries=1)
        run(trainer, checkpointer, 1)
        with pytest.raises(UploadError, match=r"gave up after 2 attempts: .*No space left on device"):
            checkpointer.close()
        assert [name for name in files_under(disk) if ".tmp" in name] == []


def test_thread_mode_replaces_a_corrupt_committed_step(fresh):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    victim = Path(cfg.checkpoint.durable_url) / step_dir_name(4) / "rank-00000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10  # one flipped bit at rest, size kept
    victim.write_bytes(bytes(data))

    again = make_trainer(cfg, seed=9)
    redo = Checkpointer(cfg, again.env, again.groups)
    again.step = redo.restore(again)
    assert again.step == 2  # step 4 does not verify: back to 2
    run(again, redo, 4)  # step 4 is redone and staged again: it must replace the corrupt copy
    redo.close()
    assert [info.step for info in catalog.committed(cfg.checkpoint.durable_url)] == [2, 4]
    newest = catalog.committed(cfg.checkpoint.durable_url)[-1]
    assert verify_checkpoint(newest.url, newest.manifest) == []
    third = make_trainer(cfg, seed=11)
    assert Checkpointer(cfg, third.env, third.groups).restore(third) == 4
    weights = [k for k in full_state(trainer) if k.startswith(("model.", "optim."))]
    assert_same_state({k: full_state(third)[k] for k in weights}, {k: full_state(trainer)[k] for k in weights})


def write_campaign(tmp_path: Path, overrides: list[str]) -> Path:
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump({"id": "c1", "recipe": str(ROOT / "configs/tiny-cpu.yaml"),
                                    "root_dir": str(tmp_path / "runs"), "overrides": overrides,
                                    "stages": [{"name": "a", "steps": 2}, {"name": "b", "steps": 2}]}))
    return path


def test_a_campaign_honours_a_staging_dir_override_and_refuses_owned_paths(tmp_path):
    campaign = load_campaign(write_campaign(tmp_path, [f"checkpoint.staging_dir={tmp_path / 'nvme'}"]))
    assert [stage_config(campaign, i).checkpoint.staging_dir for i in (0, 1)] == [
        str(tmp_path / "nvme" / "c1" / "a"), str(tmp_path / "nvme" / "c1" / "b")]
    default = load_campaign(write_campaign(tmp_path, []))
    assert stage_config(default, 0).checkpoint.staging_dir == str(tmp_path / "runs" / "c1" / "a" / "staging")
    for owned, instead in (("checkpoint.durable_url", "campaign's durable_url"), ("train.run_dir", "root_dir")):
        with pytest.raises(ConfigError, match=rf"{owned} is set by the campaign .*{instead}"):
            load_campaign(write_campaign(tmp_path, [f"{owned}={tmp_path / 'elsewhere'}"]))


OUTSIDE = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 9999]}}).encode()


def forge(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a committed file and make its manifest record agree: only parsing can tell."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for files in manifest["files"].values():
        if name in files:
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(("name", "data", "why"), [
    ("rank-00000.safetensors", struct.pack("<Q", 1 << 40) + b"{}", "header length"),
    ("rank-00000.safetensors", struct.pack("<Q", 2) + b"[]", "not a mapping"),
    ("rank-00000.safetensors", struct.pack("<Q", len(OUTSIDE)) + OUTSIDE + bytes(16), "outside the file"),
    ("rank-00000.json", b"{not json", "not valid JSON"),
], ids=["huge-header", "list-header", "offsets-outside", "bad-json"])
def test_a_file_that_does_not_parse_is_corrupt(fresh, caplog, capsys, name, data, why):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    step_dir = Path(cfg.checkpoint.durable_url) / step_dir_name(4)
    forge(step_dir, name, data)
    assert checkpoints_cli(["verify", cfg.checkpoint.durable_url]) == 1
    out = capsys.readouterr().out
    assert "step 2: ok" in out and "step 4: CORRUPT" in out and why in out and "restore would use step 2" in out
    other = make_trainer(cfg, seed=5)
    with caplog.at_level(logging.WARNING, logger="megatrain.checkpoint"):
        assert Checkpointer(cfg, other.env, other.groups).restore(other) == 2  # logged, then the step before
    assert f"{step_dir_name(4)} rejected" in caplog.text and name in caplog.text and "UnreadableFile" in caplog.text


def test_a_manifest_that_does_not_parse_is_corrupt(fresh, capsys):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    (Path(cfg.checkpoint.durable_url) / step_dir_name(4) / MANIFEST).write_text('{"files": ')
    assert checkpoints_cli(["verify", cfg.checkpoint.durable_url]) == 1
    out = capsys.readouterr().out
    assert "step 4: CORRUPT" in out and "not valid JSON" in out and "restore would use step 2" in out
    other = make_trainer(cfg, seed=5)
    assert Checkpointer(cfg, other.env, other.groups).restore(other) == 2


def test_a_committed_step_with_a_planted_symlink_is_replaced_in_one_go(fresh, tmp_path):
    """A committed file replaced by a link to a file outside: the step no longer verifies, and the
    redone step replaces it in the first rerun - the link is removed as a link (the file it points
    at is untouched), never followed, and nothing blames the staged copy."""
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    outside = tmp_path / "not-a-checkpoint.bin"
    outside.write_bytes(b"someone else's file" * 100)
    victim = Path(cfg.checkpoint.durable_url) / step_dir_name(4) / "rank-00000.safetensors"
    victim.unlink()
    victim.symlink_to(outside)

    again = make_trainer(cfg, seed=9)
    redo = Checkpointer(cfg, again.env, again.groups)
    assert redo.restore(again) == 2  # step 4 does not verify (its file leads out): back to 2
    again.step = 2
    run(again, redo, 4)  # the first rerun redoes step 4 and commits it
    redo.close()
    assert [info.step for info in catalog.committed(cfg.checkpoint.durable_url)] == [2, 4]
    newest = catalog.committed(cfg.checkpoint.durable_url)[-1]
    assert verify_checkpoint(newest.url, newest.manifest) == []
    assert not victim.is_symlink() and victim.is_file()
    assert outside.read_bytes() == b"someone else's file" * 100


def test_out_of_host_memory_mid_upload_leaves_no_partial_step_and_says_so(fresh, monkeypatch):
    """MemoryError in the middle of an upload: one line saying so, no half-uploaded step left in
    the durable store, the staged copy kept; the next upload commits it."""
    cfg, trainer, checkpointer = fresh(interval=1)
    real_put, calls = storage.put_file, {"n": 0}

    def put_then_run_out(local, url):
        calls["n"] += 1
        if calls["n"] == 2:  # the first file is up, the second runs out of memory
            raise MemoryError()
        return real_put(local, url)

    monkeypatch.setattr(storage, "put_file", put_then_run_out)
    run(trainer, checkpointer, 1)
    with pytest.raises(UploadError, match=r"out of host memory while uploading step 1; the uncommitted step was removed"):
        checkpointer.close()
    durable = Path(cfg.checkpoint.durable_url)
    assert calls["n"] == 2 and not (durable / step_dir_name(1)).exists()
    staged = Path(cfg.checkpoint.staging_dir) / step_dir_name(1)
    assert staged.is_dir()
    monkeypatch.setattr(storage, "put_file", real_put)
    upload_checkpoint(staged, str(durable))
    (info,) = catalog.committed(str(durable))
    assert info.step == 1 and verify_checkpoint(info.url, info.manifest) == []
