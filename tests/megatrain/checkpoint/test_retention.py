"""Retention keeps the newest, the last keep_last and every keep_every; never uncommitted ones."""

from __future__ import annotations

import json

from megatrain.checkpoint.files import MANIFEST, step_dir_name
from megatrain.checkpoint.retention import apply_retention, clean_staging, steps_to_delete


def test_rules():
    steps = [10, 20, 30, 40, 50]
    assert steps_to_delete(steps, keep_last=2) == [10, 20, 30]
    assert steps_to_delete(steps, keep_last=2, keep_every=20) == [10, 30]
    assert steps_to_delete(steps, keep_last=10) == []
    assert steps_to_delete([7], keep_last=1, keep_every=5) == []  # the newest always stays


def _step(root, step, committed):
    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "rank-00000.safetensors").write_bytes(b"x" * 10)
    if committed:
        (d / MANIFEST).write_text(json.dumps({"step": step, "files": {}, "bytes": 10}))
    return d


def test_apply_retention_spares_uncommitted(tmp_path):
    durable = tmp_path / "durable"
    for step, committed in [(10, True), (20, False), (30, True), (40, True), (50, False)]:
        _step(durable, step, committed)
    assert apply_retention(str(durable), keep_last=2) == [10]
    assert sorted(p.name for p in durable.iterdir()) == [step_dir_name(s) for s in (20, 30, 40, 50)]


def test_clean_staging_removes_only_committed(tmp_path):
    durable, staging = tmp_path / "durable", tmp_path / "staging"
    _step(durable, 10, True)
    _step(durable, 20, False)
    _step(staging, 10, False)
    _step(staging, 20, False)
    assert clean_staging(staging, str(durable)) == [10]
    assert [p.name for p in staging.iterdir()] == [step_dir_name(20)]
