"""benchmarks/moe_warmup.py: a few trainer steps of a tiny moe-gpu-2b on CPU, each step's metrics in
warmup-metrics.jsonl, and the model as a transformers folder that the benchmark's baseline loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("transformers")

TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.seq_len=64",
        "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_d_ff=32", "model.compile=false"]


@pytest.mark.slow
def test_warmup_trains_logs_and_exports_a_folder_the_baseline_loads(tmp_path):
    import torch

    import mfu_moe
    from megatrain.config import load_config

    out = tmp_path / "hf"
    overrides = [*TINY, "train.device=cpu", "train.steps=3", "train.micro_batch_size=2", "train.global_batch_size=4",
                 f"data.shard_url={tmp_path}/shards", "data.max_source_bytes=200000", f"train.run_dir={tmp_path}/run",
                 "checkpoint.interval=1000000", f"checkpoint.staging_dir={tmp_path}/staging",
                 f"checkpoint.durable_url={tmp_path}/ckpt"]
    decoy = tmp_path / "shards" / "0000-other-version"  # another version's tokenizer, first by name
    decoy.mkdir(parents=True)
    (decoy / "tokenizer.json").write_text('{"not": "this run\'s tokenizer"}')
    proc = subprocess.run([sys.executable, "benchmarks/moe_warmup.py", "configs/moe-gpu-2b.yaml", str(out), *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 1 loss" in proc.stdout and "load worst" in proc.stdout and f"exported to {out}" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "warmup-metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["moe"]["layers"] for r in rows)
    assert not list((tmp_path / "ckpt").glob("step-*"))  # weights only: no checkpoint (the run's record is there)
    cfg = load_config(str(ROOT / "configs/moe-gpu-2b.yaml"), TINY)
    baseline = mfu_moe.HFMoE(cfg.model, cfg.seq_len, aux_loss=False, weights=str(out))
    idx = torch.randint(0, cfg.model.vocab_size, (1, cfg.seq_len))
    assert torch.isfinite(baseline(idx, idx))
    run_tokenizer = next(p for p in (tmp_path / "shards").rglob("tokenizer.json") if p.parent != decoy)
    assert (out / "tokenizer.json").read_bytes() == run_tokenizer.read_bytes()  # the shards' own, not the decoy
