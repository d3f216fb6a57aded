"""``megatrain import`` through the real command: a bad folder ends in one line naming the key,
tensor or file (the table, in tests/test_cli_errors.py's style), and an imported Llama with its own
tokenizer continues pretraining on data and checkpoints that carry that tokenizer's sha256."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatrain.data.index import load_index
from megatrain.data.tokenizer import load_tokenizer, parse
from megatrain.errors import EXIT_INPUT
from megatrain.evaluate.heldout import held_out_windows
from tests.megatrain.conftest import ROOT, child_env
from tests.megatrain.interop.hf_folders import (
    EOS,
    VOCAB,
    copy_folder,
    edit_config,
    save_llama,
)
from tests.test_cli_errors import MAX_LINES, output_lines, run

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def _tensors(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# id: (how the good folder is spoiled, what the one line must name). "{tmp}" is the test's tmp dir.
ROWS = {
    "dynamic rope_scaling": (lambda f: edit_config(f, drop=("rope_parameters",), rope_scaling={"type": "dynamic", "factor": 4.0}),
                             ["{tmp}/bad/config.json", "rope_scaling.type='dynamic'", "megatrain computes RoPE"]),
    "an unknown key": (lambda f: edit_config(f, my_new_knob=3), ["{tmp}/bad/config.json", "my_new_knob=3"]),
    "a wrong-shaped tensor": (lambda f: _tensors(f, lambda t: t.update({K_PROJ: torch.zeros(48, 64)})),
                              [f"{K_PROJ} is [48, 64]", "config.json makes it [32, 64]"]),
    "a missing tensor": (lambda f: _tensors(f, lambda t: t.pop("model.norm.weight")),
                         ["model.norm.weight is missing (config.json makes it [64])"]),
    "a truncated config.json": (lambda f: _truncate(f / "config.json", 0.5),
                                ["{tmp}/bad/config.json: not valid JSON (JSON decode error", " at line "]),
    "a truncated model.safetensors": (lambda f: _truncate(f / "model.safetensors", 0.9),
                                      ["{tmp}/bad/model.safetensors: truncated"]),
    "pickle weights only": (lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
                            ["{tmp}/bad: no model.safetensors", "pickle"]),
    "a missing folder": (lambda f: __import__("shutil").rmtree(f), ["{tmp}/bad: no such folder"]),
    "an unsupported model_type": (lambda f: edit_config(f, model_type="bert"), ["model_type='bert'", "megatrain imports"]),
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("import-cli")
    save_llama(ws / "llama")
    return ws


@pytest.mark.parametrize("spoil, names", list(ROWS.values()), ids=list(ROWS))
@pytest.mark.slow
def test_a_bad_folder_ends_in_one_line_naming_it(ws, spoil, names, tmp_path):
    folder = copy_folder(ws / "llama", tmp_path / "bad")
    spoil(folder)
    result = run(["import", "--hf", str(folder), "--out", str(tmp_path / "r.yaml")], tmp_path)
    lines = output_lines(result)
    text = "\n".join(lines)
    assert result.returncode == EXIT_INPUT, f"exit {result.returncode}:\n{text[-3000:]}"
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{text[-3000:]}"
    assert "Traceback" not in text and "internal error" not in text, text
    for name in names:
        assert name.format(tmp=tmp_path) in text, f"{name!r} not named in:\n{text}"
    assert not (tmp_path / "r.yaml").exists()  # nothing written


def megatrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain.cli", *args], cwd=ROOT, env=child_env(), check=False,
                          capture_output=True, text=True, timeout=300)


SAMPLES = ["def wrap(text, width=70):\n    return TextWrapper(width=width).wrap(text)\n",
           "Ünïcödé and émojis 🙂 survive the byte-level round trip.", "  leading spaces\tand tabs\n\n"]


@pytest.mark.slow
def test_an_imported_llama_continues_pretraining_on_its_own_tokenizer(tmp_path):
    hf = save_llama(tmp_path / "llama", max_position_embeddings=4096)
    recipe = tmp_path / "llama-cpt.yaml"
    proc = megatrain("import", "--hf", str(tmp_path / "llama"), "--config", str(ROOT / "configs" / "llama-tiny-cpu.yaml"),
                     "--out", str(recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.seq_len 128 (the base recipe's); it allows up to 4096" in proc.stdout

    run_dir = tmp_path / "runs" / "llama-cpt"  # named after the recipe, beside it
    proc = megatrain("train", "--config", str(recipe), "data.max_source_bytes=300000", f"data.shard_url={tmp_path}/shards",
                     "data.val_fraction=0.1", "train.steps=2", "train.eval_interval=1", "checkpoint.interval=2",
                     "optim.lr=1e-12", "optim.min_lr=0", "model.kernels.cross_entropy=reference")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    sha = hashlib.sha256((tmp_path / "llama" / "tokenizer.json").read_bytes()).hexdigest()
    record = json.loads((run_dir / "run.json").read_text())
    index = load_index(record["data_index"])
    assert index.tokenizer_sha256 == sha and index.eos_id == 1  # the shards are the model's tokenizer's
    [meta] = (run_dir / "checkpoints").glob("step-00000002/rank-00000.json")
    assert json.loads(meta.read_text())["tokenizer_sha256"] == sha  # and so is the checkpoint
    assert hashlib.sha256((run_dir / "checkpoints" / "tokenizer.json").read_bytes()).hexdigest() == sha

    # the weights came in: after one step at lr 1e-12 the held-out loss (train.eval_batches 2 x 8 windows) is
    # the transformers model's own on those windows
    windows = torch.from_numpy(held_out_windows(index, 16).astype("int64"))
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert next(r["val_loss"] for r in rows if "val_loss" in r) == pytest.approx(hf_loss, abs=1e-4)

    # token ids round-trip: megatrain's tokenizer writes what transformers' encodes, and decodes back
    ours = load_tokenizer(str(tmp_path / "llama"), EOS, VOCAB)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama")
    for text in SAMPLES:
        ids = theirs(text)["input_ids"]
        assert ids[0] == theirs.bos_token_id
        assert ours.encode_documents([text]) == [ids + [theirs.eos_token_id]]
        assert theirs.decode(ids, skip_special_tokens=True) == text
        assert parse(ours.json_text, "ours").decode(ids) == text
