"""A checkpoint remembers the tokenizer of its data (sha256): a run on data of another tokenizer
is refused, naming both, before it can feed the embeddings other text under the same ids; and so
is a base model (``checkpoint.init_from: hf:<dir>``) whose own tokenizer is not the data's."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import pytest

from megatrain.data.tokenizer import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.mark.slow
def test_resuming_on_data_of_another_tokenizer_is_refused_naming_both(run_training, tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(train_bpe([(STDLIB / "textwrap.py").read_text()], 1024, "<|endoftext|>").json_text)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((STDLIB / "difflib.py").read_text())
    common = [f"data.sources=[{corpus}]", f"data.tokenizer={tokenizer}", "checkpoint.interval=2"]
    first, _ = run_training([*common, "train.steps=2"])
    assert first[-1]["step"] == 2
    first_sha = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/rank-00000.json")).read_text())
    assert meta["tokenizer_sha256"] == first_sha  # recorded with the checkpoint

    # the same path, another tokenizer: the shards are new, the checkpoint's ids mean other text
    tokenizer.write_text(train_bpe([(STDLIB / "argparse.py").read_text()], 1024, "<|endoftext|>").json_text)
    _, proc = run_training([*common, "train.steps=4"], check=False)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # deterministic: no restart helps
    second_sha = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    assert f"tokenizer sha256 {first_sha[:16]}" in proc.stderr and f"tokenizer sha256 {second_sha[:16]}" in proc.stderr


def test_a_base_model_with_another_tokenizer_than_the_data_is_refused(tmp_path):
    from megatrain.config import ConfigError
    from megatrain.data.index import ShardIndex
    from megatrain.training.trainer import check_tokenizer_of_base_model

    model = tmp_path / "base"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"the": "base model\'s own"}')
    own = hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()
    index = ShardIndex(url=str(tmp_path / "v"), version="v", seq_len=8, vocab_size=10, eos_id=0, dtype="uint16",
                       num_samples=1, num_tokens=9, shards=[], tokenizer_file="tokenizer.json",
                       tokenizer_sha256="0" * 64)
    with pytest.raises(ConfigError, match=rf"hf:{model}: its tokenizer .*{own[:16]}.* is not the data's .*0000000000000000"):
        check_tokenizer_of_base_model(f"hf:{model}", index)
    check_tokenizer_of_base_model(f"hf:{model}", ShardIndex(**{**index.__dict__, "tokenizer_sha256": own}))
    check_tokenizer_of_base_model(None, index)  # no base model: nothing to compare
