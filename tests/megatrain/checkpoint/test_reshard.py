"""Layout-independent restore, with the real trainer as gloo ranks (up to 4 processes).

A run saves at one layout after 3 steps; copies of its checkpoint are restored at other layouts,
each training 3 more steps. Reference: one process (dp1) training the 6 steps straight, same
global batch. After the switch, every restored run must match the reference within 1e-5: the
losses and gradient norms of steps 4-6, and the full (unsharded) weights, fp32 master weights and
optimizer moments of its step-6 checkpoint. Across the switch, the samples consumed (recorded by
reshard_worker.py) must be the stream's order exactly: no duplicate, no gap.

LAMB: saved at dp2 x tp2, ZeRO-1; restored at dp4, tp2 x pp2, dp1, pp2.
AdamW: saved at dp2 ZeRO-2, restored at tp2 without ZeRO (partitions -> plain optimizer state) and
at dp2 ZeRO-3; saved at dp2 ZeRO-3, restored at dp1 ZeRO-1.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatrain.checkpoint import reshard
from megatrain.checkpoint.files import rank_meta_file, step_dir_name
from megatrain.launch.forked import ForkLaunch, run_to_end

REPO = Path(__file__).resolve().parents[3]
SAVE_STEP, STEPS, GLOBAL_BATCH = 3, 6, 8
TOL = 1e-5

pytestmark = pytest.mark.slow  # torchrun ranks (and Prefect flows): still part of make test


@pytest.fixture(scope="module")
def shards() -> tuple[str, list[str]]:
    """Shards, and the sha1 of each of the first STEPS * GLOBAL_BATCH samples of the stream."""
    import hashlib
    import tempfile

    from megatrain.config import load_config
    from megatrain.data.loader import build_loader
    from megatrain.data.shard import shard_corpus

    url = tempfile.mkdtemp(prefix="reshard-shards-")
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", ["data.max_source_bytes=300000", f"data.shard_url={url}"])
    index = shard_corpus(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)
    stream = build_loader(index, micro_batch_size=1, dp_rank=0, dp_size=1, seed=cfg.data.seed, prefetch_batches=0,
                          shuffle_shards=cfg.data.shuffle_shards)
    order = [hashlib.sha1(stream.next_raw()[0, 0].tobytes()).hexdigest() for _ in range(STEPS * GLOBAL_BATCH)]
    yield url, order
    shutil.rmtree(url, ignore_errors=True)


def _train(run_dir: Path, shard_url: str, nproc: int, steps: int, *overrides: str,
           config: str = "configs/tiny-cpu.yaml") -> None:
    args = ["model.n_layer=2", "data.max_source_bytes=300000", f"data.shard_url={shard_url}", "data.prefetch_batches=0",
            "optim.decay_steps=6", "train.log_interval=1000", f"train.run_dir={run_dir}",
            f"checkpoint.interval={SAVE_STEP}", f"train.global_batch_size={GLOBAL_BATCH}", f"train.steps={steps}",
            f"checkpoint.staging_dir={run_dir}/staging", f"checkpoint.durable_url={run_dir}/durable", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RESHARD_SAMPLES=str(run_dir / "samples"))
    env = dict(env, PYTHONPATH=f"{REPO}:{env.get('PYTHONPATH', '')}")
    # the ranks forked from this worker's warm server (as a flow's CPU ranks are), with torchrun's environment
    launch = ForkLaunch(["--config", config, *args], nproc, script=str(Path(__file__).with_name("reshard_worker.py")))
    code, output = run_to_end(launch, env, REPO, timeout_s=600)
    (run_dir / "train.log").write_text(output)
    assert code == 0, output[-8000:]


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _samples(*run_dirs: Path) -> list[tuple[int, int, str]]:
    """(position, dp_rank, sha1) consumed; tensor/pipeline peers of one DP rank count once."""
    seen = set()
    for run_dir in run_dirs:
        for path in run_dir.glob("samples.*"):
            seen |= {tuple(row) for row in map(json.loads, path.read_text().splitlines())}
    return sorted(seen)


def _full(run_dir: Path, step: int) -> reshard.FullState:
    step_dir = run_dir / "durable" / step_dir_name(step)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    dims = reshard.old_dims(manifest)
    metas = {r: json.loads((step_dir / rank_meta_file(r)).read_text()) for r in range(dims.world_size)}
    return reshard.read_full_state(metas, dims, lambda name: load_file(step_dir / name))


def _worst(a: reshard.FullState, b: reshard.FullState) -> float:
    """Largest absolute difference over weights, fp32 masters and per-element optimizer state."""
    assert a.params.keys() == b.params.keys()
    worst = 0.0
    for name, pa in a.params.items():
        pb = b.params[name]
        assert pa.state.keys() == pb.state.keys(), name
        pairs = [(pa.weight, pb.weight), (pa.fp32, pb.fp32)] + [(pa.state[k], pb.state[k]) for k in pa.state]
        for x, y in [(x, y) for x, y in pairs if x is not None or y is not None]:  # a buffer has no fp32 master
            assert x.shape == y.shape, name
            worst = max(worst, (x.float() - y.float()).abs().max().item())
    return worst


def _check_switch(tmp_path: Path, shards, saved: Path, name: str, nproc: int, reference: Path, *overrides: str) -> str:
    url, order = shards
    run_dir = tmp_path / "".join(c if c.isalnum() else "-" for c in name)
    shutil.copytree(saved / "durable", run_dir / "durable")
    _train(run_dir, url, nproc, STEPS, *overrides)
    got, want = _metrics(run_dir), _metrics(reference)
    assert sorted(got) == list(range(SAVE_STEP + 1, STEPS + 1)), f"{name}: did not resume at step {SAVE_STEP}"
    assert "resharded" in (run_dir / "train.log").read_text(), f"{name}: restored without resharding"
    loss = max(abs(got[s]["loss"] - want[s]["loss"]) for s in got)
    # DeepSpeed reports no global grad norm without ZeRO (0.0): those steps are checked through
    # the weights and moments only
    grad = max([abs(got[s]["grad_norm"] - want[s]["grad_norm"]) for s in got if got[s]["grad_norm"]], default=0.0)
    state = _worst(_full(run_dir, STEPS), _full(reference, STEPS))
    samples = _samples(saved, run_dir)
    assert [p for p, _, _ in samples] == list(range(STEPS * GLOBAL_BATCH)), f"{name}: duplicate or missing samples"
    assert [h for _, _, h in samples] == order, f"{name}: samples out of the stream's order"
    assert max(loss, grad, state) <= TOL, f"{name}: loss {loss:.2e} grad norm {grad:.2e} state {state:.2e}"
    grads = "n/a" if not any(got[s]["grad_norm"] for s in got) else f"{grad:.1e}"
    return f"{name:>26}: |loss| {loss:.1e}  |grad norm| {grads}  |weights, masters, moments| {state:.1e}"


def test_lamb_zero1_dp2_tp2_restores_at_dp4_tp2pp2_dp1_pp2(tmp_path, shards):
    url, _ = shards
    reference, saved = tmp_path / "reference", tmp_path / "saved-dp2-tp2"
    _train(reference, url, 1, STEPS, "train.micro_batch_size=8")
    _train(saved, url, 4, SAVE_STEP, "parallel.tp=2", "train.micro_batch_size=4")
    rows = [
        _check_switch(tmp_path, shards, saved, "dp4", 4, reference, "train.micro_batch_size=2"),
        _check_switch(tmp_path, shards, saved, "tp2 x pp2", 4, reference, "parallel.tp=2", "parallel.pp=2",
                      "train.micro_batch_size=2"),
        _check_switch(tmp_path, shards, saved, "dp1", 1, reference, "train.micro_batch_size=4"),
        _check_switch(tmp_path, shards, saved, "pp2", 2, reference, "parallel.pp=2", "train.micro_batch_size=4"),
    ]
    print("\nLAMB ZeRO-1 saved at dp2 x tp2, step 3 -> 6 vs one process straight:\n" + "\n".join(rows))


def test_adamw_zero2_and_zero3_restore_across_stages_and_layouts(tmp_path, shards):
    url, _ = shards
    adamw = ("optim.name=adamw", "optim.lr=1e-3", "optim.min_lr=1e-4")
    reference, zero2, zero3 = tmp_path / "reference", tmp_path / "saved-dp2-zero2", tmp_path / "saved-dp2-zero3"
    _train(reference, url, 1, STEPS, "train.micro_batch_size=8", *adamw)
    _train(zero2, url, 2, SAVE_STEP, "parallel.zero_stage=2", "train.micro_batch_size=4", *adamw)
    _train(zero3, url, 2, SAVE_STEP, "parallel.zero_stage=3", "train.micro_batch_size=4", *adamw)
    rows = [
        _check_switch(tmp_path, shards, zero2, "ZeRO-2 dp2 -> tp2 ZeRO-0", 2, reference, "parallel.tp=2",
                      "parallel.zero_stage=0", "train.micro_batch_size=8", *adamw),
        _check_switch(tmp_path, shards, zero2, "ZeRO-2 dp2 -> dp2 ZeRO-3", 2, reference, "parallel.zero_stage=3",
                      "train.micro_batch_size=2", *adamw),
        _check_switch(tmp_path, shards, zero3, "ZeRO-3 dp2 -> dp1 ZeRO-1", 1, reference, "train.micro_batch_size=4",
                      *adamw),
    ]
    print("\nAdamW, step 3 -> 6 vs one process straight:\n" + "\n".join(rows))
