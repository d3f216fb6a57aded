"""FP8 through the whole engine on CPU (train.fp8.emulate: torchao's FP8 casts with the GEMM in
high precision; the real trainer, DeepSpeed and checkpoints, in child processes): GPT trains
beside bf16 under ZeRO-2 with activation checkpointing and the serial block; the Llama family
beside bf16 under ZeRO-0; 2 ZeRO-3 ranks match 1 (the guard's amax over partitions included);
and a ZeRO-1 run killed after a checkpoint resumes bit-exactly (no scale state to lose: torchao
0.18 scales dynamically)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint.files import step_dir_name
from megatrain.checkpoint.manager import KILL_AFTER_COMMIT_ENV
from megatrain.launch.forked import ForkLaunch, run_to_end

REPO = Path(__file__).resolve().parents[3]
FP8 = ["train.precision=fp8", "train.fp8.emulate=true", "reliability.anomaly.fp8_check_interval=1"]
SMALL = ["model.n_layer=2", "data.max_source_bytes=300000", "checkpoint.interval=1000", "train.steps=4",
         "optim.warmup_steps=2", "data.prefetch_batches=0"]


def _losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics]


@pytest.mark.slow
def test_fp8_trains_beside_bf16_with_activation_checkpointing_and_the_serial_block(run_training):
    common = SMALL + ["parallel.zero_stage=2", "model.activation_checkpointing=true", "model.block=serial"]
    bf16, _ = run_training(common, name="bf16")
    fp8, _ = run_training(common + FP8, name="fp8")
    assert len(fp8) == len(bf16) == 4
    for a, b in zip(fp8, bf16):  # same data, same initial weights: FP8 rounding moves the loss by < 1%
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    assert _losses(fp8) != _losses(bf16)  # the casts did happen
    assert all(m["fp8"]["fp8_nonfinite"] == 0 and 0 < m["fp8"]["fp8_amax_max"] < 1 for m in fp8)
    assert all(m["fp8"] is None for m in bf16)


@pytest.mark.slow
def test_fp8_llama_trains_beside_bf16_under_zero0(run_training):
    llama = REPO / "configs" / "llama-tiny-cpu.yaml"
    common = ["data.max_source_bytes=300000", "checkpoint.interval=1000", "train.steps=3", "data.prefetch_batches=0",
              "parallel.zero_stage=0"]
    bf16, _ = run_training(common, name="llama-bf16", config=llama)
    fp8, _ = run_training(common + FP8, name="llama-fp8", config=llama)
    assert len(fp8) == len(bf16) == 3
    for a, b in zip(fp8, bf16):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    assert _losses(fp8) != _losses(bf16) and all(m["fp8"]["fp8_nonfinite"] == 0 for m in fp8)


@pytest.mark.slow
def test_fp8_moe_trains_beside_high_precision(run_training):
    """moe-tiny-cpu through the trainer: the dense linears in torchao's emulated FP8, the expert
    banks through the FP8 grouped GEMMs' emulation (kernels/fp8_grouped.py), the routers kept."""
    moe = REPO / "configs" / "moe-tiny-cpu.yaml"
    common = ["data.max_source_bytes=300000", "checkpoint.interval=1000", "train.steps=3", "data.prefetch_batches=0"]
    high, _ = run_training(common, name="moe-high", config=moe)
    fp8, _ = run_training(common + FP8 + ["train.fp8.experts=true"], name="moe-fp8", config=moe)
    assert len(fp8) == len(high) == 3
    for a, b in zip(fp8, high):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    assert _losses(fp8) != _losses(high) and all(m["fp8"]["fp8_nonfinite"] == 0 for m in fp8)
    assert all(m["moe"]["max_over_mean"] > 0 for m in fp8)  # the routers' health is still measured


def _steps(nproc: int, shard_url: Path, run_dir: Path, overrides: list[str], steps: int = 3) -> list[dict]:
    """train_steps.py as ``nproc`` ranks: the metrics of each step (no final checkpoint: ZeRO-3)."""
    paths = [f"data.shard_url={shard_url}", f"train.run_dir={run_dir}", f"checkpoint.staging_dir={run_dir}/staging",
             f"checkpoint.durable_url={run_dir}/durable"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    launch = ForkLaunch([str(steps), "--config", "configs/tiny-cpu.yaml", *paths, *overrides], nproc,
                        script=str(Path(__file__).with_name("train_steps.py")))  # forked, torchrun's environment
    code, output = run_to_end(launch, env, REPO, 300)
    assert code == 0, output[-6000:]
    return [json.loads(line[5:]) for line in output.splitlines() if line.startswith("STEP ")]


@pytest.mark.slow
def test_two_zero3_ranks_match_one_in_fp8(tmp_path, shard_root):
    common = SMALL + FP8 + ["parallel.zero_stage=3", "optim.name=adamw", "train.micro_batch_size=4",
                            "train.global_batch_size=8"]
    single = _steps(1, shard_root, tmp_path / "single", common)
    double = _steps(2, shard_root, tmp_path / "double", common)
    assert len(single) == len(double) == 3
    for a, b in zip(single, double):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        # the guard all-reduces the partitions' amax: both layouts see the same weights
        assert a["fp8"]["fp8_amax_max"] == pytest.approx(b["fp8"]["fp8_amax_max"], rel=1e-4)
        assert a["fp8"]["fp8_underflow"] == pytest.approx(b["fp8"]["fp8_underflow"], rel=1e-3, abs=1e-7)
    assert single[-1]["loss"] < single[0]["loss"]


@pytest.mark.slow
def test_two_pipeline_stages_match_one_in_fp8(tmp_path, shard_root):
    """Precision converts the blocks before the pipeline splits them; the guard combines the
    stages' statistics, so both stages report what one process sees."""
    common = SMALL + FP8
    single = _steps(1, shard_root, tmp_path / "single", common)
    staged = _steps(2, shard_root, tmp_path / "pp2", [*common, "parallel.pp=2"])
    assert len(single) == len(staged) == 3
    for a, b in zip(single, staged):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        assert a["fp8"]["fp8_amax_max"] == pytest.approx(b["fp8"]["fp8_amax_max"], rel=1e-5)
        assert a["fp8"]["fp8_amax_min"] == pytest.approx(b["fp8"]["fp8_amax_min"], rel=1e-5)
        assert a["fp8"]["fp8_underflow"] == pytest.approx(b["fp8"]["fp8_underflow"], rel=1e-3, abs=1e-7)


def _launch(run_dir: Path, shard_url: Path, kill_after: int | None = None) -> subprocess.CompletedProcess:
    overrides = [*FP8, "model.n_layer=1", "train.steps=4", "checkpoint.interval=2", "data.max_source_bytes=300000",
                 f"data.shard_url={shard_url}", "train.log_interval=1000", f"train.run_dir={run_dir}",
                 f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable",
                 "data.prefetch_batches=0", "model.dropout=0.1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(KILL_AFTER_COMMIT_ENV, None)
    if kill_after is not None:
        env[KILL_AFTER_COMMIT_ENV] = str(kill_after)
    return subprocess.run([sys.executable, "-m", "megatrain.cli", "train", "--config", "configs/tiny-cpu.yaml", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _tensors(durable: Path, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((durable / step_dir_name(step)).glob("*.safetensors")):
        out.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    return out


@pytest.mark.slow
def test_fp8_run_killed_after_a_checkpoint_resumes_bit_exactly(tmp_path, shard_root):
    straight = _launch(tmp_path / "straight", shard_root)
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = _launch(tmp_path / "crashed", shard_root, kill_after=2)
    assert crashed.returncode != 0 and "killing rank" in crashed.stderr + crashed.stdout
    resumed = _launch(tmp_path / "crashed", shard_root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 2)" in resumed.stderr + resumed.stdout  # restored, not restarted
    expected, actual = _tensors(tmp_path / "straight" / "durable", 4), _tensors(tmp_path / "crashed" / "durable", 4)
    assert expected.keys() == actual.keys() and len(expected) > 0
    assert [k for k in expected if not torch.equal(expected[k], actual[k])] == []
