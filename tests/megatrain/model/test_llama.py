"""The Llama family's parts in the one model: parameter counts by formula, GQA against MHA and
the dense mask, RoPE's relative-position property, the KV cache against the full forward, the
pipeline's layer list, and construction on the meta device."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.kernels.attention import attention_reference, causal_attention, repeat_kv
from megatrain.model import GPT, count_parameters, expected_parameter_count, init_weights
from megatrain.model.cache import KVCache
from megatrain.model.norm import RMSNorm

LLAMA = dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, position="rope",
             norm="rmsnorm", mlp="swiglu", bias=False, d_ff=48)


@pytest.mark.parametrize(
    "position, norm, mlp, n_kv_head, bias, tied, block",
    [combo for combo in itertools.product(["learned", "rope"], ["layernorm", "rmsnorm"], ["gelu", "swiglu"], [None, 2, 1],
                                          [True, False], [True, False], ["parallel", "serial"])
     if combo[:3] in {("learned", "layernorm", "gelu"), ("rope", "rmsnorm", "swiglu"), ("rope", "layernorm", "gelu"),
                      ("learned", "rmsnorm", "swiglu")}],
)
def test_parameter_count_matches_formula_for_every_family_and_block(position, norm, mlp, n_kv_head, bias, tied, block):
    cfg = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, seq_len=16, position=position, norm=norm, mlp=mlp,
                      n_kv_head=n_kv_head, bias=bias, tie_embeddings=tied, block=block)
    assert count_parameters(GPT(cfg)) == expected_parameter_count(cfg)


def test_llama_3_2_1b_and_3_8b_parameter_counts():
    """Meta's published sizes: Llama-3.2-1B 1,235,814,400 (tied); Llama-3-8B 8,030,261,248."""
    small = ModelConfig(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, seq_len=8192,
                        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, block="serial")
    big = small.model_copy(update=dict(n_layer=32, d_model=4096, d_ff=14336, tie_embeddings=False))
    assert expected_parameter_count(small) == 1_235_814_400
    assert expected_parameter_count(big) == 8_030_261_248


def test_swiglu_hidden_size_is_rounded_as_llama():
    # Llama 2 7B: d 4096 -> 11008; Llama 3 8B: d 4096, multiplier 1.3, multiple_of 1024 -> 14336
    assert ModelConfig(d_model=4096, n_head=32, mlp="swiglu").ffn_dim == 11008
    assert ModelConfig(d_model=4096, n_head=32, mlp="swiglu", ffn_multiplier=1.3, ffn_multiple_of=1024).ffn_dim == 14336
    assert ModelConfig(d_model=4096, n_head=32, mlp="swiglu", d_ff=1000).ffn_dim == 1000


def _qkv(H=4, G=2, T=20, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, T, hd, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, G, T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("impl", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 5])
def test_gqa_equals_multi_head_attention_on_repeated_kv_heads(impl, window):
    """GQA is MHA whose query heads h*G/H.. share a KV head: equal to MHA on the repeated k, v."""
    q, k, v = _qkv()
    if impl == "flex":
        q, k, v = q.float(), k.float(), v.float()
    gqa = causal_attention(q, k, v, window, impl)
    mha = attention_reference(q, repeat_kv(k, 4), repeat_kv(v, 4), window)
    torch.testing.assert_close(gqa, mha, atol=2e-5 if impl == "flex" else 1e-12, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_sliding_gqa_equals_the_dense_mask(impl):
    """Sliding + GQA through SDPA/FlexAttention against softmax over an explicit dense mask."""
    q, k, v = (t.float() for t in _qkv(T=24))
    window = 6
    kk, vv = repeat_kv(k, 4), repeat_kv(v, 4)
    scores = q @ kk.transpose(-2, -1) / 8**0.5
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    dense = (j <= i) & (i - j < window)
    want = torch.softmax(scores.masked_fill(~dense, float("-inf")), -1) @ vv
    torch.testing.assert_close(causal_attention(q, k, v, window, impl), want, atol=2e-5, rtol=1e-5)


def test_model_with_n_kv_head_equal_n_head_is_multi_head():
    """n_kv_head = n_head builds the same parameters and computes the same as leaving it unset."""
    torch.manual_seed(0)
    mha = GPT(ModelConfig(**{**LLAMA, "n_kv_head": None}))
    torch.manual_seed(0)
    same = GPT(ModelConfig(**{**LLAMA, "n_kv_head": 4}))
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(mha(idx), same(idx), atol=0, rtol=0)


def test_rope_scores_depend_on_relative_positions_only():
    """<rope(q, m), rope(k, n)> depends on m - n: shifting both positions leaves the score equal."""
    from megatrain.kernels.rope import rope_inv_freq, rope_reference, rope_tables

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64)
    inv = rope_inv_freq(16, 10000.0).double()

    def score(m, n):
        cq, sq = rope_tables(inv, 1, m)
        ck, sk = rope_tables(inv, 1, n)
        return float((rope_reference(q, cq, sq) * rope_reference(k, ck, sk)).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-6)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


@pytest.mark.parametrize("overrides", [{}, {"block": "serial"}, {"attention": "sliding", "window": 5},
                                       {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}])
def test_cached_incremental_decoding_equals_the_full_forward(overrides):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**LLAMA, **overrides})).eval()
    idx = torch.randint(0, 256, (2, 12))
    full = model(idx)  # [2, 12, V]
    cache = KVCache(model.cfg.n_layer)
    pieces = [model(idx[:, :5], cache=cache)]  # the prompt
    for t in range(5, 12):  # then one token at a time
        pieces.append(model(idx[:, t : t + 1], cache=cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_rmsnorm_model_norms_are_rmsnorm_and_rope_has_no_table():
    model = GPT(ModelConfig(**LLAMA))
    assert isinstance(model.head.ln_f, RMSNorm) and model.embed.wpe is None
    names = set(dict(model.named_parameters()))
    assert "blocks.0.attn.qkv.weight" in names and not any("bias" in n for n in names)
    assert model.blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert model.blocks[0].mlp.fc.weight.shape == (2 * 48, 32)


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_layers_reproduce_forward_and_loss_is_causal(block):
    model = GPT(ModelConfig(**LLAMA, block=block))
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for layer in model.layers():
        x = layer(x)
    logits = model(idx)
    torch.testing.assert_close(x, logits)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])


def test_builds_on_the_meta_device_and_initialises_after():
    cfg = ModelConfig(**LLAMA)
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    init_weights(model, cfg)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8)))).all()
    assert torch.all(model.head.ln_f.weight == 1)


def test_rope_tables_stay_exact_fp32_through_casts_and_are_not_state():
    model = GPT(ModelConfig(**LLAMA))
    rope = model.blocks[0].attn.rope
    exact = rope.cos.clone()
    model.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32 and torch.equal(rope.cos, exact)
    assert not any("cos" in name or "sin" in name for name in model.state_dict())


def test_decoding_past_the_trained_context_uses_positions_beyond_the_tables():
    """RoPE has no table in the state dict: a model with seq_len 8 decoding 14 tokens equals the
    same weights in a model built for seq_len 16."""
    torch.manual_seed(0)
    short = GPT(ModelConfig(**{**LLAMA, "seq_len": 8})).eval()
    long = GPT(ModelConfig(**{**LLAMA, "seq_len": 16})).eval()
    long.load_state_dict(short.state_dict())
    idx = torch.randint(0, 256, (1, 14))
    cache = KVCache(2)
    pieces = [short(idx[:, :6], cache=cache)] + [short(idx[:, t : t + 1], cache=cache) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), long(idx), atol=1e-5, rtol=1e-5)
