import pytest

from megatrain.config import ModelConfig
from megatrain.model.gpt import expected_parameter_count
from megatrain.observe.mfu import flops_per_token, mfu, non_embedding_params, peak_flops

GPT_1_3B = ModelConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=2048)


def test_gpt_1_3b_by_hand():
    """Counted by hand for d=2048, ff=8192, 24 parallel blocks with biases, tied vocab 50304:
    per block: attention 4d^2 + 4d = 16,785,408; MLP 2*d*ff + ff + d = 33,564,672; one LayerNorm
    2d = 4,096 -> 50,354,176; x 24 = 1,208,500,224. Plus token embedding V*d = 103,022,592 and
    the final LayerNorm 4,096: N = 1,311,526,912 (the 4,194,304 position embeddings excluded)."""
    n_params = expected_parameter_count(GPT_1_3B)
    assert n_params == 1_311_526_912 + 2048 * 2048
    assert non_embedding_params(GPT_1_3B, n_params) == 1_311_526_912
    # 6N = 7,869,161,472; attention 12 * 24 * 2048 * 2048 = 1,207,959,552
    assert flops_per_token(GPT_1_3B, n_params) == 9_077_121_024


def test_small_config_and_window_by_hand():
    cfg = ModelConfig(vocab_size=16, n_layer=2, n_head=1, d_model=4, seq_len=8)
    assert flops_per_token(cfg, 1000) == 6 * (1000 - 32) + 12 * 2 * 4 * 8  # 5808 + 768
    windowed = cfg.model_copy(update={"attention": "sliding", "window": 4})
    assert flops_per_token(windowed, 1000) == 6 * 968 + 12 * 2 * 4 * 4


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12),
    ("NVIDIA H200", 989.4e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("cpu", None),
    ("Some Future Accelerator", None),
])
def test_peak_flops_table(name, peak):
    assert peak_flops(name) == peak


def test_mfu():
    # 66% of an H200 at the 1.3B model's 9.077 GFLOP/token is about 71,940 tokens/s
    assert mfu(71_940, 9_077_121_024, 989.4e12) == pytest.approx(0.66, rel=1e-4)
    assert mfu(1e5, 1e9, None) is None


LLAMA_1B = ModelConfig(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, seq_len=2048,
                       position="rope", norm="rmsnorm", mlp="swiglu", bias=False, block="serial")


def test_llama_3_2_1b_by_hand():
    """d=2048, 32 query heads of 64, 8 KV heads (kv width 512), SwiGLU ff=8192, 16 serial blocks,
    no biases, tied vocab 128256, RoPE (no position table). Per block: q 2048*2048 = 4,194,304;
    k and v 2 * 512*2048 = 2,097,152; o 4,194,304; gate, up, down 3 * 2048*8192 = 50,331,648;
    two RMSNorm gains 4,096 -> 60,821,504; x 16 = 973,144,064. Token embedding (= the head's
    matrix) 262,668,288 and the final norm 2,048: N = 1,235,814,400."""
    n_params = expected_parameter_count(LLAMA_1B)
    assert n_params == 1_235_814_400
    assert non_embedding_params(LLAMA_1B, n_params) == n_params  # RoPE: nothing to subtract
    # 6N = 7,414,886,400; attention 12 * 16 * 2048 * 2048 = 805,306,368 (all 32 query heads attend)
    assert flops_per_token(LLAMA_1B, n_params) == 8_220_192_768
    # GQA's smaller K/V show in N: multi-head would add 16 blocks x 2 x (2048 - 512) x 2048
    mha = LLAMA_1B.model_copy(update={"n_kv_head": None})
    assert flops_per_token(mha, expected_parameter_count(mha)) - 8_220_192_768 == 6 * 16 * 2 * 1536 * 2048
