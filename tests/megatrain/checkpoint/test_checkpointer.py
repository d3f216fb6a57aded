"""The Checkpointer in one process: bit-exact resume, reused buffers, fallback, modes, errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatrain.checkpoint import catalog
from megatrain.config.compat import fingerprint
from megatrain.checkpoint.files import STAGED, step_dir_name
from megatrain.checkpoint.manager import Checkpointer
from megatrain.checkpoint.restore import CheckpointError, CheckpointMismatch
from megatrain.checkpoint.upload import ready_steps, upload_staged_step

from checkpoint_fakes import assert_same_state, full_state, make_config, make_trainer, run


def test_resume_is_bit_exact(fresh):
    _, straight, checkpointer = fresh(interval=4)
    run(straight, checkpointer, 8)
    checkpointer.close()
    expected = full_state(straight)

    cfg, first, checkpointer = fresh("resumed", interval=4)
    run(first, checkpointer, 4)
    checkpointer.close()
    second = make_trainer(cfg, seed=99)  # different weights and data seed: both must come back
    resumed = Checkpointer(cfg, second.env, second.groups)
    second.step = resumed.restore(second)
    assert second.step == 4
    run(second, resumed, 8)
    resumed.close()
    assert_same_state(full_state(second), expected)


def test_resume_restores_every_random_generator(tmp_path):
    """Dropout and python's and numpy's generators drawn in every step come back exactly: checked
    in a process of its own (resume_generators.py), where no other thread draws from them."""
    from megatrain.launch.forked import run_module

    done = run_module("resume_generators", [str(tmp_path)], cwd=Path(__file__).parent, timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_save_blocks_for_the_copy_and_reuses_buffers(fresh):
    cfg, trainer, checkpointer = fresh(interval=1)
    run(trainer, checkpointer, 3)
    checkpointer.close()
    timing = checkpointer.last_timing
    assert not timing.allocated  # the third save reused the first save's buffers
    assert timing.blocked_s < 1.0
    assert [info.step for info in catalog.committed(cfg.checkpoint.durable_url)] == [1, 2, 3]


def test_manifest_records_the_run(fresh):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 2)
    checkpointer.close()
    manifest = catalog.committed(cfg.checkpoint.durable_url)[-1].manifest
    assert manifest["step"] == 2 and manifest["fingerprint"] == fingerprint(cfg)
    assert manifest["layout"] == {"dp": 1, "tp": 1, "pp": 1, "world_size": 1, "zero_stage": cfg.parallel.zero_stage}
    assert manifest["data_position"] == {"0": {"seed": 0, "position": 2}}
    assert set(manifest["versions"]) == {"torch", "deepspeed", "megatrain"}
    files = manifest["files"]["rank-00000"]
    assert set(files) == {"model-pp00-tp00.safetensors", "rank-00000.safetensors", "rank-00000.json"}
    assert all(set(record) == {"size", "sha256"} for record in files.values())


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_corrupt_newest_falls_back_to_previous(fresh, caplog, damage):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    victim = cfg.checkpoint.durable_url + f"/{step_dir_name(4)}/rank-00000.safetensors"
    with open(victim, "r+b") as handle:
        data = bytearray(handle.read())
        if damage == "truncate":
            handle.truncate(len(data) // 2)
        else:
            handle.seek(len(data) - 5)
            handle.write(bytes([data[-5] ^ 0x10]))
    other = make_trainer(cfg, seed=5)
    with caplog.at_level(logging.WARNING, logger="megatrain.checkpoint"):
        step = Checkpointer(cfg, other.env, other.groups).restore(other)
    assert step == 2
    assert "rank-00000.safetensors" in caplog.text and ("size" in caplog.text if damage == "truncate" else "sha256" in caplog.text)


def test_all_corrupt_is_an_error_not_a_fresh_start(fresh):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 2)
    checkpointer.close()
    path = f"{cfg.checkpoint.durable_url}/{step_dir_name(2)}/rank-00000.json"
    with open(path, "a") as handle:
        handle.write(" ")
    other = make_trainer(cfg)
    with pytest.raises(CheckpointError, match="none verified"):
        Checkpointer(cfg, other.env, other.groups).restore(other)


def test_other_config_is_a_clear_error(fresh, tmp_path):
    cfg, trainer, checkpointer = fresh(interval=2)
    run(trainer, checkpointer, 2)
    checkpointer.close()
    changed = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 1.0})})
    other = make_trainer(changed)
    with pytest.raises(CheckpointMismatch, match=r"optim.lr: 0.0003 -> 1.0.*allow_schedule_change"):
        Checkpointer(changed, other.env, other.groups).restore(other)
    changed = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layer": 3})})
    with pytest.raises(CheckpointMismatch, match=r"model.n_layer: 12 -> 3"):
        Checkpointer(changed, other.env, other.groups).restore(other)


def test_external_mode_stages_and_the_flow_commits(fresh):
    cfg, trainer, checkpointer = fresh(interval=2, upload_mode="external", keep_last=1)
    run(trainer, checkpointer, 4)
    checkpointer.close()
    staging = cfg.checkpoint.staging_dir
    assert ready_steps(staging) == [2, 4]
    assert catalog.committed(cfg.checkpoint.durable_url) == []  # the trainer uploads nothing
    for step in ready_steps(staging):
        result = upload_staged_step(staging, cfg.checkpoint.durable_url, step, backoff_s=0.05)
        assert result["committed"] and result["step"] == step
    assert ready_steps(staging) == []  # staging space freed once committed
    assert [i.step for i in catalog.committed(cfg.checkpoint.durable_url)] == [2, 4]
    # a re-run of the task (a Prefect retry) finds the step committed and does nothing
    staged_again = Path(staging) / step_dir_name(4)
    staged_again.mkdir(parents=True)
    (staged_again / STAGED).write_text("{}")
    assert upload_staged_step(staging, cfg.checkpoint.durable_url, 4)["bytes"] == 0


def test_init_from_takes_weights_and_optimizer_only(fresh, tmp_path):
    cfg, trainer, checkpointer = fresh(interval=3)
    run(trainer, checkpointer, 3)
    checkpointer.close()
    weights = {k: v.clone() for k, v in trainer.engine.module.state_dict().items()}
    stage2 = make_config(tmp_path / "stage2", init_from=cfg.checkpoint.durable_url, durable_url=tmp_path / "stage2-durable")
    other = make_trainer(stage2, seed=7)
    assert Checkpointer(stage2, other.env, other.groups).restore(other) == 0  # its own step count
    assert all((other.engine.module.state_dict()[k] == v).all() for k, v in weights.items())
    assert other.loader.position == 0  # its own data position
    assert other.engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # its own schedule
    assert other.engine.optimizer.state  # but the moments came along


def test_thread_mode_applies_retention_and_cleans_staging(fresh):
    cfg, trainer, checkpointer = fresh(interval=1, keep_last=2, keep_every=2)
    run(trainer, checkpointer, 5)
    checkpointer.close()
    assert [info.step for info in catalog.committed(cfg.checkpoint.durable_url)] == [2, 4, 5]
    staging = Path(cfg.checkpoint.staging_dir)
    assert not any(staging.iterdir())  # every staged step is committed, so none is kept
