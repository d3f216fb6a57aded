"""Held-out evaluation: a validation split of whole documents that training never sees, and a
validation loss that is the same under every parallel layout (and for a finished checkpoint)."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from megatrain.config import DataConfig
from megatrain.data.shard import is_held_out, shard_corpus
from megatrain.evaluate.heldout import evaluate_checkpoint, held_out_windows, text_windows
from megatrain.interop.checkpoint import load_run
from megatrain.observe.tensorboard import read_scalars
from tests.megatrain.conftest import ROOT, child_env

MARK = re.compile(r"<doc (\d{5})>")


def test_validation_documents_never_appear_in_training_samples(tmp_path):
    docs = [f"<doc {i:05d}> " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40)) for i in range(400)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(sources=[str(corpus)], shard_url=str(tmp_path / "shards"), samples_per_shard=32,
                     val_fraction=0.2, bpe_vocab_size=400)
    index = shard_corpus(cfg, seq_len=64, vocab_size=512)
    assert index.val_shards and all(s.name.startswith("val-shard-") for s in index.val_shards)
    assert not {s.name for s in index.shards} & {s.name for s in index.val_shards}

    tokenizer = Tokenizer.from_file(str(tmp_path / "shards" / index.version / "tokenizer.json"))

    def documents(split: str) -> set[int]:
        windows = held_out_windows(index, 10**9, split)
        assert len(windows) == (index.val_num_samples if split == "val" else index.num_samples)
        return {int(m) for w in windows for m in MARK.findall(tokenizer.decode(w.tolist()))}

    train, val = documents("train"), documents("val")
    assert train and val
    assert not train & val  # no document on both sides
    expected_val = {i for i, d in enumerate(docs) if is_held_out(d, 0.2)}
    assert val <= expected_val and train.isdisjoint(expected_val)
    assert 40 < len(expected_val) < 120  # about a fifth of 400 documents
    # the held-out documents are gone from the training stream, not just marked
    assert len(val) > 0.8 * len(expected_val)


def test_without_a_fraction_the_shards_are_those_of_before(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("hello world, " * 400)
    cfg = DataConfig(sources=[str(corpus)], shard_url=str(tmp_path / "s"), bpe_vocab_size=300)
    index = shard_corpus(cfg, seq_len=32, vocab_size=512)
    assert index.val_shards == [] and "val_fraction" not in index.params


# cp2: each rank's chunks of every window through the ring, the token sums reduced over dp x cp
LAYOUTS = {"dp2": ["parallel.tp=1"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"]}
COMMON = ["data.max_source_bytes=400000", "data.val_fraction=0.1", "train.steps=2", "train.eval_interval=1",
          "train.eval_batches=2", "train.micro_batch_size=4", "train.global_batch_size=8", "checkpoint.interval=2",
          "optim.warmup_steps=1", "model.kernels.cross_entropy=reference"]


@pytest.mark.slow
def test_validation_loss_is_the_same_in_one_process_dp2_tp2_pp2_cp2_and_from_each_checkpoint(run_training, tmp_path):
    single, _ = run_training(COMMON, nproc=1, name="single")
    reference = [(m["step"], m["val_loss"]) for m in single]
    assert [s for s, _ in reference] == [1, 2] and all(v is not None and 3 < v < 9 for _, v in reference)
    # the same values reached TensorBoard through the metrics path
    tb = read_scalars(tmp_path / "single" / "tb")
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in tb["val/loss"]] == reference
    assert len(tb["train/loss"]) == 2

    runs, losses = {"single": reference}, {}
    for name, overrides in LAYOUTS.items():
        rows, _ = run_training(COMMON + overrides, nproc=2, name=name)
        runs[name], losses[name] = [(m["step"], m["val_loss"]) for m in rows], [m["loss"] for m in rows]
        for (step, value), (ref_step, ref_value) in zip(runs[name], reference, strict=True):
            assert step == ref_step and value == pytest.approx(ref_value, abs=1e-5), (name, runs[name], reference)

    # evaluating changes nothing in training: the same DP2 run without evaluation has the same losses
    quiet, _ = run_training(COMMON + LAYOUTS["dp2"] + ["train.eval_interval=0"], nproc=2, name="dp2-no-eval")
    assert [m["loss"] for m in quiet] == losses["dp2"] and all(m["val_loss"] is None for m in quiet)

    # a finished checkpoint of every layout, gathered into one process, gives the last value again
    proc = subprocess.run([sys.executable, "-m", "megatrain.cli", "eval", "--checkpoint", str(tmp_path / "single")],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {"single": json.loads(proc.stdout)}
    results.update({name: evaluate_checkpoint(str(tmp_path / name)) for name in LAYOUTS})  # the same, in-process
    for name, result in results.items():
        assert result["step"] == 2 and result["samples"] == 16
        assert result["loss"] == pytest.approx(reference[-1][1], abs=1e-5), (name, result)

    # or on a user's own text, cut into windows of the run's tokens as its shards are
    text = (ROOT / "megatrain" / "evaluate" / "heldout.py").read_text()
    (tmp_path / "code.py").write_text(text)
    result = evaluate_checkpoint(str(tmp_path / "single"), data=str(tmp_path / "code.py"), samples=4)
    assert result["split"] == "text" and result["samples"] == 4 and 0 < result["loss"] < 20
    run = load_run(str(tmp_path / "single"))
    windows = text_windows(run, [str(tmp_path / "code.py")], 4)
    assert windows.shape == (4, 129) and windows.flatten().tolist() == run.tokenizer().encode(text).ids[: 4 * 129]
    # the same text in a JSONL file under a key of the user's own ("content"), named by --text-field
    (tmp_path / "code.jsonl").write_text(json.dumps({"content": text}) + "\n")
    assert (text_windows(run, [str(tmp_path / "code.jsonl")], 4, text_field="content") == windows).all()
    proc = subprocess.run([sys.executable, "-m", "megatrain.cli", "eval", "--checkpoint", str(tmp_path / "single"),
                           "--data", str(tmp_path / "code.jsonl"), "--text-field", "content", "--samples", "4"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["loss"] == pytest.approx(result["loss"], abs=1e-6)
    # without it, the run's own field (text) is not in the file: one line naming the field and the file
    proc = subprocess.run([sys.executable, "-m", "megatrain.cli", "eval", "--checkpoint", str(tmp_path / "single"),
                           "--data", str(tmp_path / "code.jsonl"), "--samples", "4"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "code.jsonl" in proc.stderr and "text" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_validation_loss_under_the_document_mask_is_the_same_in_a_pipeline(run_training, tmp_path):
    """pp2 under model.attention_mask=document: the evaluation's micro-batches carry their document
    ids into the stages as training's do, so the held-out and training losses equal one process's.
    The corpus is the first 40 kB of sources (short files: windows that hold a document boundary)."""
    short = [c for c in COMMON if not c.startswith("data.max_source_bytes")] + [
        "data.max_source_bytes=40000", f"data.shard_url={tmp_path / 'short-shards'}", "model.attention=full"]
    single, _ = run_training(short + ["model.attention_mask=document"], nproc=1, name="single-document")
    piped, _ = run_training(short + ["model.attention_mask=document", "parallel.pp=2"], nproc=2, name="pp2-document")
    causal, _ = run_training(short, nproc=1, name="single-causal")
    for got, want in zip(piped, single, strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], abs=1e-5), (piped, single)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (piped, single)
    # the mask changes what is measured (2.3e-4 here): the comparison above is not of plain causal runs
    assert abs(single[0]["val_loss"] - causal[0]["val_loss"]) > 5e-5, (single, causal)
