"""The preflight (``megatrain/reliability/preflight.py``) and the checkpoint size it checks against
(``megatrain.parallel.plan.checkpoint_size``), and what a rank does with a failure known at its
start (``megatrain/training/rank.py``): one line from rank 0, before step 1, with the documented
exit code.

The size is held to real committed checkpoints of the tiny recipe (1 rank, 2 ranks at ZeRO-0 and
ZeRO-1), measured file by file. The tmpfs cases need root and skip otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain import storage
from megatrain.config import load_config
from megatrain.errors import (
    DETERMINISTIC_PREFIX,
    EXIT_CONFIG,
    EXIT_DETERMINISTIC,
    DeterministicError,
)
from megatrain.parallel.plan import RANK_OVERHEAD, checkpoint_size, params_per_gpu
from megatrain.reliability.preflight import preflight, targets

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def deterministic_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if DETERMINISTIC_PREFIX in line]


def test_the_parameter_count_is_the_models():
    from megatrain.model.gpt import expected_parameter_count

    for recipe in ("tiny-cpu", "llama-tiny-cpu", "gpt-175b", "llama-8b"):
        cfg = load_config(ROOT / "configs" / f"{recipe}.yaml")
        assert params_per_gpu(cfg, tp=1, pp=1) == expected_parameter_count(cfg.model), recipe


def test_the_size_follows_dtype_zero_stage_and_pipeline():
    cfg = load_config(TINY)
    P = params_per_gpu(cfg, tp=1, pp=1)
    assert checkpoint_size(cfg, 1, cuda=False).total == P * (4 + 12) + RANK_OVERHEAD  # fp32 weights, master + m + v
    assert checkpoint_size(cfg, 1, cuda=True).total == P * (2 + 12) + RANK_OVERHEAD  # bf16 weights
    zero0 = load_config(TINY, ["parallel.zero_stage=0", "train.micro_batch_size=2"])
    assert checkpoint_size(zero0, 4, cuda=False).total == P * (4 + 4 * 8) + 4 * RANK_OVERHEAD  # m + v per DP rank
    zero3 = load_config(TINY, ["parallel.zero_stage=3", "train.micro_batch_size=2"])
    assert checkpoint_size(zero3, 4, cuda=True).total == P * 12 + 4 * RANK_OVERHEAD  # weights live in the partitions
    pipe = load_config(TINY, ["parallel.pp=2"])  # tied embeddings: the last stage keeps a copy
    V, d = cfg.model.vocab_size, cfg.model.d_model
    assert checkpoint_size(pipe, 2, cuda=True).total == (P + V * d) * 14 + 2 * RANK_OVERHEAD

    # staging: a node holds its own ranks' files, at least the largest rank's
    big = load_config(TINY, ["train.micro_batch_size=1", "parallel.gpus_per_node=2"])
    size = checkpoint_size(big, 8, ranks_per_node=2, cuda=True)
    rank0 = P * 2 + -(-P * 12 // 8) + RANK_OVERHEAD  # DP rank 0: the weights and its eighth of the state
    assert size.largest_rank == rank0
    assert size.per_node == rank0 + -(-P * 12 // 8) + RANK_OVERHEAD
    assert size.per_node < size.total


@pytest.mark.slow
@pytest.mark.parametrize("nproc, zero", [(1, 1), (2, 1), (2, 0)])
def test_the_size_matches_a_committed_checkpoint(run_training, tmp_path, nproc, zero):
    """Two steps of the tiny recipe, committed at step 2: the durable step's files, summed, are
    what checkpoint_size predicts, within 10% (measured: within 0.5% in every case)."""
    overrides = ["train.steps=2", "checkpoint.interval=2", "train.device=cpu", f"parallel.zero_stage={zero}",
                 f"train.micro_batch_size={8 // nproc}"]
    run_training(overrides, nproc=nproc)
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    measured = sum(p.stat().st_size for p in step.iterdir())
    predicted = checkpoint_size(load_config(TINY, overrides), nproc, cuda=False).total
    print(f"\ntiny recipe, {nproc} rank(s), ZeRO-{zero}: predicted {predicted} bytes, committed {measured} bytes "
          f"({predicted / measured - 1:+.2%})")
    assert predicted == pytest.approx(measured, rel=0.10)


def test_targets_ask_the_staging_dir_for_a_node_and_the_durable_store_for_whole_checkpoints(tmp_path):
    cfg = load_config(TINY, [f"train.run_dir={tmp_path}/run", f"checkpoint.staging_dir={tmp_path}/staging",
                             f"checkpoint.durable_url={tmp_path}/durable", "train.micro_batch_size=1",
                             "parallel.gpus_per_node=2"])
    size = checkpoint_size(cfg, 8, ranks_per_node=2)
    run, staging, durable = targets(cfg, size)
    assert (run.label, run.needed) == ("train.run_dir", 0)
    assert (staging.label, staging.needed) == ("checkpoint.staging_dir", 2 * size.per_node)
    assert (durable.label, durable.needed) == ("checkpoint.durable_url", 2 * size.total)
    assert targets(cfg, size, local=False) == [durable]
    results = preflight(cfg, 8, 2)
    assert [r.url for r in results] == [f"{tmp_path}/run", f"{tmp_path}/staging", f"{tmp_path}/durable"]
    assert [p for p in tmp_path.rglob("*")] == []  # nothing left, not even the directories it made


def test_preflight_on_a_read_only_durable_dir(tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "ro", 2**20, read_only=True) as disk:
        cfg = load_config(TINY, [f"train.run_dir={tmp_path}/run", f"checkpoint.staging_dir={tmp_path}/staging",
                                 f"checkpoint.durable_url={disk}/ckpt"])
        with pytest.raises(storage.LocationNotWritable, match=rf"^checkpoint.durable_url {disk}/ckpt is not writable: "
                                                              r"OSError: \[Errno 30\] Read-only file system"):
            preflight(cfg, cuda=False)


@pytest.mark.slow
def test_megatrain_train_with_a_read_only_durable_dir_fails_before_step_1(run_training, tmp_path, mount_tmpfs):
    with mount_tmpfs(tmp_path / "ro", 4 * 2**20, read_only=True) as disk:
        metrics, proc = run_training(["train.steps=2", f"checkpoint.durable_url={disk}/ckpt"], check=False)
    assert proc.returncode == EXIT_DETERMINISTIC, proc.stderr[-2000:]
    (line,) = deterministic_lines(proc.stdout + proc.stderr)
    two = 2 * checkpoint_size(load_config(TINY), 1, cuda=False).total
    assert re.fullmatch(rf"{DETERMINISTIC_PREFIX}LocationNotWritable: checkpoint.durable_url {disk}/ckpt is not "
                        rf"writable: OSError: \[Errno 30\] Read-only file system; it must hold two checkpoints "
                        rf"\(2 x {two // 2} bytes\): {two} bytes \(.*\), {4 * 2**20} bytes \(4.0 MiB\) free", line), line
    run_dir = tmp_path / "run"
    assert metrics == [] and not (run_dir / "heartbeats").exists()  # no step, not even a process group
    assert "model:" not in proc.stdout  # the model was never built


def test_megatrain_train_on_a_too_small_durable_disk_fails_before_step_1(run_training, tmp_path, mount_tmpfs):
    size = checkpoint_size(load_config(TINY), 1, cuda=False).total
    with mount_tmpfs(tmp_path / "small", size) as disk:  # room for one checkpoint, not two
        metrics, proc = run_training(["train.steps=2", f"checkpoint.durable_url={disk}/ckpt"], check=False)
        assert list(disk.iterdir()) == []
    assert proc.returncode == EXIT_DETERMINISTIC
    (line,) = deterministic_lines(proc.stdout + proc.stderr)
    assert line.endswith(f"LocationTooSmall: checkpoint.durable_url {disk}/ckpt: too small for two checkpoints "
                         f"(2 x {size} bytes): needs {2 * size} bytes (20.7 MiB), {size} bytes (10.4 MiB) free"), line
    assert metrics == []


@pytest.mark.slow
def test_a_global_batch_three_ranks_cannot_split_is_one_line_from_rank_0(run_training, tmp_path):
    """A recipe whose global batch of 16 does not split over 3 data-parallel ranks (as when a
    checkpoint of 2 ranks is restored on 3): every rank finds it before any process group, rank 0
    alone says it, and each exits with EXIT_CONFIG (torchrun reports each rank's code)."""
    metrics, proc = run_training(["train.micro_batch_size=2", "train.global_batch_size=16", "train.device=cpu"],
                                 nproc=3, check=False, launcher="torchrun")
    assert proc.returncode != 0 and metrics == []
    (line,) = deterministic_lines(proc.stdout + proc.stderr)
    assert line == (f"{DETERMINISTIC_PREFIX}train.global_batch_size 16 is not divisible by train.micro_batch_size * dp "
                    "= 2 * 3 = 6 (dp: the data-parallel size, world size / (tp * pp))")
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s+exitcode\s*: (-?\d+)", proc.stderr))
    assert codes["0"] == str(EXIT_CONFIG), proc.stderr
    # the others exit alike, unless torchrun's SIGTERM (after rank 0's exit) reaches them first
    assert {codes["1"], codes["2"]} <= {str(EXIT_CONFIG), "-15"}, proc.stderr

    # rank 1 on its own (torchrun's environment, no peers needed: nothing waits for a group yet)
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    silent = subprocess.run([sys.executable, "-m", "megatrain.train", "--config", str(TINY), "train.micro_batch_size=2",
                             "train.global_batch_size=16", "train.device=cpu", f"train.run_dir={tmp_path}/rank1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert silent.returncode == EXIT_CONFIG and silent.stdout == silent.stderr == ""


def test_the_batch_rule_is_a_deterministic_value_error():
    """ConfigError-class: deterministic for the launcher, a ValueError for pydantic's validators."""
    cfg = load_config(TINY)
    with pytest.raises(ValueError, match="train.global_batch_size 8 is not divisible") as failed:
        cfg.train.grad_accumulation_steps(3)
    assert isinstance(failed.value, DeterministicError)
