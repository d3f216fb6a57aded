"""benchmarks/bound.py: its GEMM list is the model's, its traffic floors are consistent, and the
script runs end to end on CPU (a tiny model; the real numbers come from a GPU: benchmarks/RESULTS.md)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bound  # noqa: E402
from megatrain.config import ModelConfig  # noqa: E402
from megatrain.model.gpt import GPT  # noqa: E402

TINY = dict(vocab_size=96, n_layer=2, n_head=2, d_model=32, seq_len=16)
LLAMA = dict(n_head=4, n_kv_head=2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, d_ff=48)


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_gemm_flops_are_six_n_per_token_over_the_models_matrices(block, family):
    """6N of the MFU formula counts every matrix once per token (LayerNorm/bias vectors and the
    position table aside): the bound's GEMM list must cover exactly those matrices."""
    m = ModelConfig(**{**TINY, **family}, block=block)
    matrices = sum(p.numel() for name, p in GPT(m).named_parameters() if p.dim() == 2 and "wpe" not in name)
    tokens = 3 * m.seq_len
    assert bound.micro_batch_gemm_flops(m, tokens) == 6 * matrices * tokens


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt", "llama"])
def test_run_executes_exactly_the_counted_gemms(family):
    m = ModelConfig(**{**TINY, **family})
    kernels = bound.MicroBatchKernels(m, micro_batch=2, device=torch.device("cpu"), dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        kernels.run(gemms=True, attention=None)
    assert counter.get_total_flops() == bound.micro_batch_gemm_flops(m, kernels.tokens)


def test_floors_epilogue_below_separate_and_biases_counted_only_when_present():
    tokens, n_params = 4096, 10**6
    with_bias = bound.floor_bytes(ModelConfig(**TINY, bias=True), tokens, n_params, 8)
    without = bound.floor_bytes(ModelConfig(**TINY, bias=False), tokens, n_params, 8)
    assert with_bias["epilogue"]["total"] < with_bias["separate"]["total"]
    qkv_bias = TINY["n_layer"] * tokens * 3 * TINY["d_model"] * 2  # one bf16 read of dqkv per layer
    assert with_bias["separate"]["total"] - without["separate"]["total"] == qkv_bias
    serial = bound.floor_bytes(ModelConfig(**TINY, block="serial"), tokens, n_params, 8)
    assert serial["epilogue"]["total"] > with_bias["epilogue"]["total"]  # two LayerNorms per layer


def test_script_writes_rows_for_full_attention_and_each_window(tmp_path):
    out = tmp_path / "bound.json"
    assert bound.main(["--config", str(ROOT / "configs/tiny-cpu.yaml"), "--device", "cpu", "--windows", "64,32",
                       "--iters", "1", "--baseline-tokens-per-s", "1e9", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["attended_context"] for r in result["rows"]] == [128, 64, 32]
    for r in result["rows"]:
        assert r["gemm_plus_attention_ms"] > 0 and r["separate_ms"] > r["epilogue_ms"] > r["gemm_plus_attention_ms"]
        assert r["targets_reachable"] == {"separate": False, "epilogue": False}  # 1e9 tokens/s is out of reach


def test_script_runs_for_the_llama_family(tmp_path):
    out = tmp_path / "bound.json"
    assert bound.main(["--config", str(ROOT / "configs/llama-tiny-cpu.yaml"), "--device", "cpu", "--windows", "64",
                       "--iters", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["attended_context"] for r in result["rows"]] == [128, 64]
    rope = result["floor_bytes"]["separate"]["RoPE on q and k, fwd + bwd: read, write each way"]
    assert rope == 4 * 8 * 128 * (128 + 64) * 2 * 2  # 4 passes x tokens (mb 8) x (d + kv) x bf16 x 2 layers
