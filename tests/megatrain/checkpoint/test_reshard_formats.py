"""Resharding's pieces in one process (the torchrun end-to-end runs are in test_reshard.py):
TP cut/join with the fused-QKV interleave, canonical names through the wrappers, and checkpoints
of the format before parameter maps and field records (they still load at their own layout)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from checkpoint_fakes import assert_same_state, full_state, make_trainer, run

from megatrain.checkpoint import catalog, names, reshard
from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import CheckpointMismatch


@pytest.mark.parametrize("interleave", [1, 3, [16, 4, 4]])
def test_tp_cut_then_join_is_the_whole_tensor(interleave):
    from megatrain.parallel.tensor_parallel import _shard

    full = torch.arange(12 * 8 * 5, dtype=torch.float32).reshape(12 * 2, 20)
    for world in (1, 2, 4):
        shards = [reshard._cut_tp(full, [0, interleave], r, world) for r in range(world)]
        for r, shard in enumerate(shards):  # the same cut tensor_parallel makes when it builds the layer
            assert torch.equal(shard, _shard(full, 0, r, world, interleave))
        assert torch.equal(reshard._join_tp(shards, [0, interleave]), full)
    assert reshard._cut_tp(full, None, 1, 2) is full


def test_a_grouped_query_qkv_is_cut_per_block():
    """Llama's fused qkv with 16 query rows and 4 + 4 KV rows (sizes, as JSON gives them back):
    TP rank r holds its query rows, then its K rows, then its V rows."""
    full = torch.arange(24, dtype=torch.float32)[:, None].expand(24, 3)
    rows = reshard._cut_tp(full, [0, [16, 4, 4]], 1, 2)[:, 0].tolist()
    assert rows == [*range(8, 16), 18, 19, 22, 23]
    assert torch.equal(reshard._join_tp([reshard._cut_tp(full, [0, [16, 4, 4]], r, 2) for r in (0, 1)], [0, [16, 4, 4]]), full)


def test_canonical_names_drop_the_wrappers():
    assert names.canonical_name("blocks.3.block.attn.qkv.weight") == "blocks.3.attn.qkv.weight"
    assert names.canonical_name("blocks.0._orig_mod.mlp.fc.bias") == "blocks.0.mlp.fc.bias"
    assert names.canonical_name("embed.wte.weight") == "embed.wte.weight"


def _as_old_format(step_dir: Path) -> None:
    """Rewrite a committed step as the writer before resharding wrote it: no parameter map, no
    field records or history in the rank JSON, no ZeRO stage in the layout (manifest updated)."""
    manifest_path = step_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["layout"].pop("zero_stage")
    for rank_files in manifest["files"].values():
        for name in [n for n in rank_files if n.endswith(".json")]:
            meta = json.loads((step_dir / name).read_text())
            for key in ("shards", "state_fields", "schedule_fields", "history"):
                meta.pop(key)
            data = json.dumps(meta).encode()
            (step_dir / name).write_bytes(data)
            rank_files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def test_checkpoint_of_the_previous_format_still_loads(fresh):
    _, straight, checkpointer = fresh(interval=2)
    run(straight, checkpointer, 4)
    checkpointer.close()
    expected = full_state(straight)

    cfg, first, checkpointer = fresh("old", interval=2)
    run(first, checkpointer, 2)
    checkpointer.close()
    _as_old_format(Path(catalog.committed(cfg.checkpoint.durable_url)[-1].url))
    # another config: without field records, the old checkpoint cannot say what differs
    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 500})})
    other = make_trainer(longer)
    with pytest.raises(CheckpointMismatch, match="before checkpoints recorded their fields"):
        Checkpointer(longer, other.env, other.groups).restore(other)

    second = make_trainer(cfg, seed=99)
    resumed = Checkpointer(cfg, second.env, second.groups)
    second.step = resumed.restore(second)
    assert second.step == 2
    run(second, resumed, 4)
    resumed.close()
    assert_same_state(full_state(second), expected)


def test_restore_removes_uncommitted_steps_of_an_abandoned_attempt(fresh):
    """A step uploaded but never committed by a dead attempt (its rank markers maybe of another
    layout) is redone by the next one: restore removes it, so the committer cannot mix markers."""
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 2)
    checkpointer.close()
    durable = Path(cfg.checkpoint.durable_url)
    stale = durable / "step-00000004"
    stale.mkdir()
    (stale / "rank-00001.done.json").write_text(json.dumps({"rank": 1, "step": 4, "fingerprint": "another layout"}))
    again = make_trainer(cfg)
    assert Checkpointer(cfg, again.env, again.groups).restore(again) == 2
    assert not stale.exists() and [i.step for i in catalog.committed(str(durable))] == [2]
