"""A mixture's validation: every component holds out whole documents (a tiny one too, or says
why it cannot), each is evaluated on its own, and val_loss is their mix under fixed weights
(by default a campaign's first stage's)."""

import json
import os
import re
import socket

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer

from megatrain.config import Config, DataConfig, ModelConfig
from megatrain.config.campaign import CampaignConfig, load_campaign, stage_config
from megatrain.config.compat import fingerprint
from megatrain.config.load import ConfigError
from megatrain.data.held_out import Reserve, document_hash, is_held_out
from megatrain.data.mixture import Component
from megatrain.data.shard import shard_corpus
from megatrain.evaluate.heldout import Evaluator, evaluate_checkpoint, rank_rounds
from megatrain.evaluate.validation_sets import held_out_windows
from megatrain.model.gpt import GPT
from megatrain.parallel.dims import ParallelDims, ProcessGroups
from tests.megatrain.conftest import ROOT

MARK = re.compile(r"<doc (\d{5})>")
SEQ_LEN = 64


def documents(prefix: int, count: int, words: int) -> list[str]:
    return [f"<doc {prefix + i:05d}> " + " ".join(f"w{(prefix + i * 7 + j) % 89}" for j in range(words))
            for i in range(count)]


def shard(tmp_path, name: str, docs: list[str], val_fraction: float = 0.05, **data):
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = data.pop("tokenizer", "bpe")
    cfg = DataConfig(sources=[str(corpus)], shard_url=str(tmp_path / "shards" / name), samples_per_shard=16,
                     val_fraction=val_fraction, bpe_vocab_size=400, tokenizer=tokenizer, **data)
    return shard_corpus(cfg, seq_len=SEQ_LEN, vocab_size=512)


def marks(index, split: str) -> set[int]:
    tokenizer = Tokenizer.from_file(index.tokenizer_url)
    return {int(m) for w in held_out_windows(index, 10**9, split) for m in MARK.findall(tokenizer.decode(w.tolist()))}


def test_a_tiny_component_holds_out_its_documents_of_smallest_hash_and_a_one_document_one_says_why(tmp_path):
    big = shard(tmp_path, "big", documents(0, 300, 60))
    tokenizer = big.tokenizer_url  # every component with the big one's tokenizer, as a mixture's share one

    # 6 documents of ~1,500 tokens, cut into 3 work units (64 KiB JSONL ranges): the fraction holds out none
    tiny_docs = documents(1000, 6, 4000)
    assert not any(is_held_out(d, 0.05) for d in tiny_docs)  # the old rule alone: no held-out document
    tiny = shard(tmp_path, "tiny", tiny_docs, tokenizer=tokenizer, unit_bytes=1 << 16)
    assert len(tiny.inputs["files"]) == 1 and tiny.params["unit_bytes"] == 1 << 16
    assert tiny.val_shards and tiny.val_documents == 1
    assert "held out 0 of its 6 documents" in tiny.val_note and "1 more" in tiny.val_note
    smallest = min(range(6), key=lambda i: document_hash(tiny_docs[i]))
    assert marks(tiny, "val") == {1000 + smallest}  # the document of smallest hash, whatever the units
    assert marks(tiny, "train") == {1000 + i for i in range(6)} - {1000 + smallest}  # never on both sides
    whole = shard(tmp_path, "tiny-one-unit", tiny_docs, tokenizer=tokenizer)  # the same corpus in one unit
    assert marks(whole, "val") == marks(tiny, "val") and whole.val_num_samples == tiny.val_num_samples
    assert whole.num_samples == tiny.num_samples  # nothing lost: the reserve's other documents train

    # a component whose fraction gives enough keeps the plain rule (the old test covers its documents)
    assert big.val_note == "" and big.val_documents == sum(is_held_out(d, 0.05) for d in documents(0, 300, 60))

    one = shard(tmp_path, "one", documents(2000, 1, 4000), tokenizer=tokenizer)
    assert one.val_shards == [] and one.val_documents == 0
    assert one.val_note.startswith("no validation split: 1 document of ") and "keep one to train on" in one.val_note
    assert marks(one, "train") == {2000} and one.num_samples > 0


def test_a_reserve_keeps_the_smallest_hashes_for_one_window_and_duplicates_together():
    reserve, trained = Reserve(window=10), []
    for digest, length in [(50, 4), (10, 4), (40, 4), (30, 4), (20, 4), (20, 4), (5, 20)]:
        trained += reserve.offer(digest, [digest] * length)
    kept = [digest for digest, _ in reserve.documents()]
    assert kept == [5]  # one document of 20 tokens fills the window alone
    assert sorted(ids[0] for ids in trained) == [10, 20, 20, 30, 40, 50]
    reserve = Reserve(window=10)
    for digest in (30, 20, 20, 10):
        reserve.offer(digest, [digest] * 4)
    assert [d for d, _ in reserve.documents()] == [10, 20, 20]  # 8 tokens without the pair: it stays whole


class OneProcess:
    """The engine interface the evaluator calls (DeepSpeed's, here a plain module in one process)."""

    def __init__(self, model):
        self.module = model

    def __call__(self, inputs, targets):
        return self.module(inputs, targets)

    def eval(self):
        self.module.eval()

    def train(self, mode=True):
        self.module.train(mode)


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=512, n_layer=1, n_head=2, d_model=32, seq_len=SEQ_LEN))


def by_hand(model, windows: np.ndarray) -> float:
    tokens = torch.from_numpy(windows.astype(np.int64))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="mean").item()


def mixture_config(tmp_path, weights: dict[str, float], **train) -> Config:
    mixture = [{"name": name, "sources": ["unused"], "weight": w} for name, w in weights.items()]
    return Config.model_validate({
        "model": {"vocab_size": 512, "n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": SEQ_LEN},
        "data": {"mixture": mixture, "val_fraction": 0.05},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "eval_batches": 2, "run_dir": str(tmp_path / "run"),
                  **train}})


def test_each_component_and_the_mix_equal_a_reference_by_hand(tmp_path):
    big = shard(tmp_path, "big", documents(0, 300, 60))
    tiny = shard(tmp_path, "tiny", documents(1000, 6, 150), tokenizer=big.tokenizer_url)  # ~300 tokens each
    one = shard(tmp_path, "one", documents(2000, 1, 4000), tokenizer=big.tokenizer_url)
    components = [Component("big", big, 0.6), Component("tiny", tiny, 0.3), Component("one", one, 0.1)]
    model = tiny_model()
    groups = ProcessGroups(ParallelDims(dp=1, tp=1, pp=1), rank=0)

    cfg = mixture_config(tmp_path, {"big": 0.6, "tiny": 0.3, "one": 0.1})
    evaluator = Evaluator(cfg, components, groups, torch.device("cpu"), grad_accumulation=2)
    result = evaluator.evaluate(OneProcess(model))
    big_windows = held_out_windows(big, 16)  # eval_batches * global_batch_size of its held-out windows
    tiny_windows = held_out_windows(tiny, 16)
    assert len(big_windows) == 16 and 0 < len(tiny_windows) < 8  # tiny: less than one global batch, all of it
    reference = {"big": by_hand(model, big_windows), "tiny": by_hand(model, tiny_windows)}
    assert result.components == pytest.approx(reference, rel=1e-5)
    # the mix of the components with a held-out split, their weights renormalised: "one" has none
    assert result.loss == pytest.approx((0.6 * reference["big"] + 0.3 * reference["tiny"]) / 0.9, rel=1e-5)
    assert result.samples == 16 + len(tiny_windows)
    record = json.loads((tmp_path / "run" / "validation.json").read_text())
    assert record["weights"] == pytest.approx({"big": 2 / 3, "tiny": 1 / 3})
    assert record["components"]["one"]["samples"] == 0
    assert record["components"]["one"]["note"].startswith("no validation split: 1 document")
    assert record["components"]["tiny"]["documents"] == 1

    # a fixed validation mix (train.eval_weights): other weights, the same component losses
    fixed = Evaluator(mixture_config(tmp_path, {"big": 0.6, "tiny": 0.3, "one": 0.1},
                                     eval_weights={"big": 1.0, "tiny": 3.0}),
                      components, groups, torch.device("cpu"), grad_accumulation=2).evaluate(OneProcess(model))
    assert fixed.components == pytest.approx(reference, rel=1e-5)
    assert fixed.loss == pytest.approx((reference["big"] + 3 * reference["tiny"]) / 4, rel=1e-5)


def test_rounds_give_every_window_to_one_rank_once():
    for n, dp, mb in [(3, 2, 4), (16, 2, 4), (13, 4, 2), (1, 3, 1), (40, 2, 4)]:
        seen = []
        for rank in range(dp):
            rounds = rank_rounds(n, dp, mb, rank)
            assert len(rounds) == -(-n // (dp * mb))  # every rank runs as many forwards
            seen += [i for first, count in rounds for i in range(first, first + count)]
        assert sorted(seen) == list(range(n)), (n, dp, mb)


def _two_ranks(rank: int, port: int, big_url: str, tiny_url: str, out: str) -> None:
    import torch.distributed as dist

    from megatrain.data.index import load_index

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = mixture_config(__import__("pathlib").Path(out), {"big": 0.6, "tiny": 0.4})
        components = [Component("big", load_index(big_url), 0.6), Component("tiny", load_index(tiny_url), 0.4)]
        groups = ProcessGroups(ParallelDims(dp=2, tp=1, pp=1), rank=rank)  # dp_group None: the world
        result = Evaluator(cfg, components, groups, torch.device("cpu"), grad_accumulation=1).evaluate(
            OneProcess(tiny_model()))
        if rank == 0:
            (__import__("pathlib").Path(out) / "dp2.json").write_text(json.dumps([result.loss, result.components]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_data_parallel_ranks_give_the_one_process_losses_also_for_a_set_smaller_than_a_round(tmp_path):
    big = shard(tmp_path, "big", documents(0, 300, 60))
    tiny = shard(tmp_path, "tiny", documents(1000, 6, 150), tokenizer=big.tokenizer_url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_two_ranks, args=(port, big.url, tiny.url, str(tmp_path)), nprocs=2)
    loss, components = json.loads((tmp_path / "dp2.json").read_text())
    model = tiny_model()
    reference = {"big": by_hand(model, held_out_windows(big, 16)), "tiny": by_hand(model, held_out_windows(tiny, 16))}
    assert len(held_out_windows(tiny, 16)) < 8  # a round is dp 2 x micro-batch 4: rank 1 has a stand-in
    assert components == pytest.approx(reference, rel=1e-5)
    assert loss == pytest.approx(0.6 * reference["big"] + 0.4 * reference["tiny"], rel=1e-5)


def campaign(tmp_path, stage_overrides: list[list[str]], overrides: list[str] = ()) -> CampaignConfig:
    return CampaignConfig.model_validate({
        "id": "mix", "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "root_dir": str(tmp_path),
        "overrides": list(overrides),
        "stages": [{"name": f"s{i}", "steps": 2, "overrides": o} for i, o in enumerate(stage_overrides)]})


MAIN = "data.mixture=[{name: web, sources: [w], weight: 0.6}, {name: code, sources: [c], weight: 0.3}, " \
       "{name: books, sources: [b], weight: 0.1}]"
ANNEAL = "data.mixture=[{name: web, sources: [w], weight: 0.3}, {name: code, sources: [c], weight: 0.5}, " \
         "{name: books, sources: [b], weight: 0.2}]"


def test_the_validation_mix_defaults_to_the_first_stages_weights(tmp_path):
    two = campaign(tmp_path, [[MAIN], [ANNEAL]])
    first = {"web": 0.6, "code": 0.3, "books": 0.1}
    assert stage_config(two, 0).train.eval_weights == first
    assert stage_config(two, 1).train.eval_weights == first  # not the anneal's 0.3/0.5/0.2
    assert {c.name: c.weight for c in stage_config(two, 1).data.components()} == {"web": 0.3, "code": 0.5, "books": 0.2}
    # the validation mix is what is measured: it changes no fingerprint (no stage cache, no resume)
    assert fingerprint(stage_config(two, 1)) == fingerprint(stage_config(two, 1).model_copy(
        update={"train": stage_config(two, 1).train.model_copy(update={"eval_weights": None})}))

    chosen = campaign(tmp_path, [[MAIN], [ANNEAL, "train.eval_weights={code: 1}"]])
    assert stage_config(chosen, 1).train.eval_weights == {"code": 1.0}
    everywhere = campaign(tmp_path, [[MAIN], [ANNEAL]], overrides=["train.eval_weights={web: 1, code: 1}"])
    assert [stage_config(everywhere, i).train.eval_weights for i in (0, 1)] == [{"web": 1.0, "code": 1.0}] * 2
    # a stage that shares no component with the first validates on its own weights
    other = campaign(tmp_path, [[MAIN], ["data.mixture=[{name: math, sources: [m], weight: 1}]"]])
    assert stage_config(other, 1).train.eval_weights is None

    for bad, said in [("train.eval_weights={news: 1}", r"train.eval_weights names \['news'\]"),
                      ("train.eval_weights={web: -1}", r"train.eval_weights .*>= 0")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"id": "bad", "recipe": str(ROOT / "configs/tiny-cpu.yaml"),
                                        "root_dir": str(tmp_path), "stages": [
                                            {"name": "s0", "steps": 2, "overrides": [MAIN, bad]}]}))
        with pytest.raises(ConfigError, match=said):  # one error naming the field, from the campaign file
            load_campaign(path)


@pytest.mark.slow
def test_a_mixtures_validation_losses_are_the_same_in_one_process_dp2_and_pp2(run_training, tmp_path):
    """Through the real trainer: the tiny component's set is smaller than a round (dp2: rank 1 runs
    a stand-in) and not whole micro-batches (pp2: read lcm(n, 4) / n times over)."""
    import sysconfig

    stdlib = __import__("pathlib").Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / "argparse.py").read_text()
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": text[i:i + 2000]}) + "\n"
                                                for i in range(0, len(text), 2000)))
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(1000, 6, 150)))
    common = [f"data.mixture=[{{name: big, sources: [{tmp_path / 'big.jsonl'}], weight: 0.7}}, "
              f"{{name: tiny, sources: [{tmp_path / 'tiny.jsonl'}], weight: 0.3}}]", "data.val_fraction=0.05",
              "data.max_source_bytes=null", "train.steps=2", "train.eval_interval=1", "train.micro_batch_size=4",
              "train.global_batch_size=8", "checkpoint.interval=2", "optim.warmup_steps=1", "model.n_layer=2",
              "model.kernels.cross_entropy=reference"]
    single, _ = run_training(common, nproc=1, name="single")
    record = json.loads((tmp_path / "single" / "validation.json").read_text())
    tiny_samples = record["components"]["tiny"]["samples"]
    assert 0 < tiny_samples < 8 and tiny_samples % 4, record  # short of a dp2 round and of pp2's micro-batches
    keys = ("val_loss", "val_loss/big", "val_loss/tiny")
    reference = [[row[k] for k in keys] for row in single]
    assert len(reference) == 2 and all(3 < v < 12 for values in reference for v in values)
    for name, layout in {"dp2": ["parallel.tp=1"], "pp2": ["parallel.pp=2"]}.items():
        rows, _ = run_training(common + layout, nproc=2, name=name)
        assert [[row[k] for k in keys] for row in rows] == [pytest.approx(v, abs=1e-5) for v in reference], name
    # megatrain eval on a mixture's checkpoint: the same sets, each component and the mix
    result = evaluate_checkpoint(str(tmp_path / "pp2"))
    assert result["step"] == 2 and result["samples"] == sum(c["samples"] for c in record["components"].values())
    assert [result["loss"], result["components"]["big"]["loss"], result["components"]["tiny"]["loss"]] == \
        pytest.approx(reference[-1], abs=1e-5)
