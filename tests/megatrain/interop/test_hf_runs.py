"""Export and import through real runs: a run started from a locally built transformers GPT-2
(checkpoint.init_from: hf:<dir>) and `megatrain export` of its committed checkpoint."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from megatrain.data.index import load_index
from megatrain.evaluate.heldout import held_out_windows
from megatrain.interop.checkpoint import load_run
from tests.megatrain.conftest import ROOT, TINY, child_env

ONE_STEP = ["data.max_source_bytes=400000", "data.val_fraction=0.1", "train.steps=1", "train.eval_interval=1",
            "checkpoint.interval=1", "optim.lr=1e-12", "optim.min_lr=0", "model.kernels.cross_entropy=reference"]


def megatrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_starts_from_a_transformers_gpt2_and_exports_back(run_training, tmp_path):
    torch.manual_seed(5)  # the recipe's shape (configs/tiny-cpu.yaml with a serial block), random weights
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=2048, n_positions=128, n_embd=128, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()
    hf.save_pretrained(tmp_path / "gpt2")

    recipe = tmp_path / "from-gpt2.yaml"  # tiny-cpu's data and optimizer, GPT-2's model, init_from hf:<dir>
    proc = megatrain("import", "--hf", str(tmp_path / "gpt2"), "--config", str(TINY), "--out", str(recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, _ = run_training(ONE_STEP, name="from-hf", config=recipe)
    record = json.loads((tmp_path / "from-hf" / "run.json").read_text())
    windows = held_out_windows(load_index(record["data_index"]), 16)
    with torch.no_grad():
        tokens = torch.from_numpy(windows.astype("int64"))
        logits = hf(tokens[:, :-1]).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    # the held-out loss after one step at lr 1e-12 is the transformers model's own loss: its weights came in
    assert rows[0]["val_loss"] == pytest.approx(hf_loss, abs=1e-4)
    assert rows[0]["val_loss"] < 7.7  # and not a fresh random init's ln(2048) = 7.62 by accident: see below
    assert abs(rows[0]["loss"] - hf_loss) < 0.5

    proc = megatrain("export", "--checkpoint", str(tmp_path / "from-hf"), "--format", "hf", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    run = load_run(str(tmp_path / "from-hf"))
    idx = tokens[:2, :-1]
    with torch.no_grad():
        assert (exported(idx).logits - run.model(idx)).abs().max().item() < 1e-4
        assert (exported(idx).logits - hf(idx).logits).abs().max().item() < 1e-3  # lr 1e-12: still that model

    # the MegaScale recipe (parallel block, sliding window) has no exact transformers equivalent
    refused = megatrain("export", "--checkpoint", str(tmp_path / "from-hf"), "--config", str(TINY),
                        "--out", str(tmp_path / "refused"))
    assert refused.returncode == 1 and "model.block=parallel" in refused.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_a_tensor_parallel_llama_checkpoint_exports_to_llama_for_causal_lm(run_training, tmp_path):
    """GQA's qkv and SwiGLU's [gate | up] are cut block by block over TP ranks: gathered back, the
    checkpoint's held-out loss is the one the TP2 run logged, and LlamaForCausalLM computes its logits."""
    from megatrain.evaluate.heldout import evaluate_checkpoint

    rows, _ = run_training(["parallel.tp=2", "data.max_source_bytes=300000", "data.val_fraction=0.1", "train.steps=1",
                            "train.eval_interval=1", "checkpoint.interval=1", "model.kernels.cross_entropy=reference"],
                           nproc=2, name="llama-tp2", config=ROOT / "configs" / "llama-tiny-cpu.yaml")
    result = evaluate_checkpoint(str(tmp_path / "llama-tp2"))
    assert result["loss"] == pytest.approx(rows[0]["val_loss"], abs=1e-5)

    proc = megatrain("export", "--checkpoint", str(tmp_path / "llama-tp2" / "checkpoints"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.config.num_key_value_heads == 2
    idx = torch.randint(0, 2000, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported(idx).logits - load_run(str(tmp_path / "llama-tp2")).model(idx)).abs().max().item() < 1e-4
