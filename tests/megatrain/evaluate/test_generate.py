"""Generation: seeded sampling is deterministic, the KV cache gives the no-cache tokens exactly,
and `megatrain generate` samples a real checkpoint with the run's tokenizer."""

import json
import subprocess
import sys

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.evaluate.generate import Sampling, generate, next_token, prompt_ids
from megatrain.model import GPT
from tests.megatrain.conftest import ROOT, child_env

V, T = 96, 40
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, seq_len=T)
MODELS = {
    "parallel, sliding window": dict(BASE, block="parallel", attention="sliding", window=8),
    "serial, full": dict(BASE, block="serial"),
    "llama: rope, GQA, rmsnorm, swiglu": dict(BASE, block="serial", position="rope", norm="rmsnorm", mlp="swiglu",
                                             n_kv_head=2, bias=False, tie_embeddings=False),
    "llama parts, parallel block, sliding": dict(BASE, block="parallel", position="rope", norm="rmsnorm",
                                                mlp="swiglu", n_kv_head=1, attention="sliding", window=8),
}


def model_of(fields: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**fields)).eval()
    with torch.no_grad():  # sharper than the init, so different seeds really sample differently
        model.embed.wte.weight.mul_(20)
    return model


PROMPT = torch.tensor([[5, 17, 3, 60, 2], [9, 9, 1, 0, 44]])
SAMPLINGS = {
    "greedy": Sampling(max_new_tokens=30, greedy=True),
    "top-k": Sampling(max_new_tokens=30, temperature=0.9, top_k=10, seed=7),
    "top-p": Sampling(max_new_tokens=30, temperature=1.2, top_p=0.8, seed=7),
}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("sampling_name", SAMPLINGS)
def test_the_kv_cache_gives_the_no_cache_tokens(model_name, sampling_name):
    model, sampling = model_of(MODELS[model_name]), SAMPLINGS[sampling_name]
    cached = generate(model, PROMPT, sampling, use_cache=True)
    uncached = generate(model, PROMPT, sampling, use_cache=False)
    assert cached.shape == (2, PROMPT.shape[1] + 30)  # past the sliding window (8) several times
    assert torch.equal(cached, uncached)


def test_a_fixed_seed_is_deterministic_and_seeds_differ():
    model = model_of(MODELS["serial, full"])
    a = generate(model, PROMPT, Sampling(max_new_tokens=20, top_k=40, seed=1))
    b = generate(model, PROMPT, Sampling(max_new_tokens=20, top_k=40, seed=1))
    c = generate(model, PROMPT, Sampling(max_new_tokens=20, top_k=40, seed=2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generation_stops_at_the_context_and_at_the_stop_token():
    model = model_of(MODELS["serial, full"])
    assert generate(model, PROMPT, Sampling(max_new_tokens=500, greedy=True)).shape[1] == T
    greedy = generate(model, PROMPT[:1], Sampling(max_new_tokens=10, greedy=True))
    stop = int(greedy[0, PROMPT.shape[1] + 2])  # the third new token
    stopped = generate(model, PROMPT[:1], Sampling(max_new_tokens=10, greedy=True), stop_id=stop)
    assert stopped[0, -1].item() == stop and stopped.shape[1] <= PROMPT.shape[1] + 3


def test_top_k_and_top_p_only_pick_inside_their_sets():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    picks = next_token(logits, Sampling(top_k=2), torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.636, 0.234, 0.086, ...: p = 0.8 keeps the first two
    assert probs[:1].sum() < 0.8 < probs[:2].sum()
    picks = next_token(logits, Sampling(top_p=0.8), torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {0, 1}
    assert set(next_token(logits, Sampling(greedy=True), None).tolist()) == {0}
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_a_prompt_starts_as_the_run_s_documents_did(tmp_path):
    """With the BOS the data pipeline put first (TokenizerSpec._frame), whether the tokenizer's
    post-processor adds it (Llama 3) or tokenizer_config.json asked for it (Llama 2), never twice."""
    from tokenizers import Tokenizer, processors

    from tests.megatrain.interop.hf_folders import save_tokenizer

    save_tokenizer(tmp_path)  # <s> = 0 added by its post-processor, </s> = 1
    adds = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    plain.post_processor = processors.ByteLevel(trim_offsets=False)
    text = plain.encode("def f(x):").ids
    assert text[0] != 0
    assert prompt_ids(adds, "def f(x):", 0, 1) == [0, *text]
    assert prompt_ids(plain, "def f(x):", 0, 1) == [0, *text]  # the data's BOS, though the tokenizer adds none
    assert prompt_ids(plain, "def f(x):", None, 1) == text  # documents without a BOS: prompts without one
    assert prompt_ids(plain, "", None, 1) == [1]  # nothing to start from: the EOS that ended the document before
    assert prompt_ids(plain, "", 0, 1) == [0]


@pytest.mark.slow
def test_megatrain_generate_samples_a_committed_checkpoint(run_training, tmp_path):
    run_training(["model.n_layer=1", "data.max_source_bytes=300000", "train.steps=2", "checkpoint.interval=2"],
                 name="run")

    def sample(*extra: str) -> list[dict]:
        proc = subprocess.run(
            [sys.executable, "-m", "megatrain.cli", "generate", "--checkpoint", str(tmp_path / "run"),
             "--prompt", "def main(", "--prompt", "import ", "--max-tokens", "12", "--top-k", "20", "--seed", "3",
             "--json", *extra], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in proc.stdout.splitlines()]

    first, again, uncached = sample(), sample(), sample("--no-cache")
    assert first == again and [r["text"] for r in first] == [r["text"] for r in uncached]
    assert [r["prompt"] for r in first] == ["def main(", "import "] and all(r["step"] == 2 for r in first)
    assert all(r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"]) for r in first)

    from megatrain.evaluate.generate import sample_texts

    samples = sample_texts(str(tmp_path / "run"), max_new_tokens=8)
    assert len(samples) == 3 and all(s["step"] == 2 and s["text"].startswith(s["prompt"]) for s in samples)


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", MODELS)
def test_on_one_gpu_the_kv_cache_gives_the_no_cache_tokens(model_name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = model_of(MODELS[model_name]).cuda()
    for sampling in SAMPLINGS.values():
        cached = generate(model, PROMPT.cuda(), sampling, use_cache=True)
        assert torch.equal(cached, generate(model, PROMPT.cuda(), sampling, use_cache=False))
        assert torch.equal(cached, generate(model, PROMPT.cuda(), sampling, use_cache=True))  # seeded on the device
