"""benchmarks/llama_baseline.py builds Hugging Face's Llama of the recipe's shape, and it is the
same model as megatrain's Llama: with megatrain's weights copied over (q/k/v stacked in qkv,
gate/up stacked in fc) both give the same logits, RoPE with Llama 3's scaling and GQA included."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("transformers")

import llama_baseline  # noqa: E402
from megatrain.config.model import ModelConfig, RopeScaling  # noqa: E402
from megatrain.model import GPT, count_parameters  # noqa: E402

SHAPE = dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, seq_len=32, position="rope",
             rope_theta=500000.0, norm="rmsnorm", mlp="swiglu", bias=False, block="serial")


def copy_into_hf(ours: GPT, hf: torch.nn.Module, cfg: ModelConfig) -> None:
    q, kv, ff = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed.wte.weight)
        hf.model.norm.weight.copy_(ours.head.ln_f.weight)
        if not cfg.tie_embeddings:
            hf.lm_head.weight.copy_(ours.head.weight)
        for block, layer in zip(ours.blocks, hf.model.layers):
            wq, wk, wv = block.attn.qkv.weight.split([q, kv, kv])
            layer.self_attn.q_proj.weight.copy_(wq)
            layer.self_attn.k_proj.weight.copy_(wk)
            layer.self_attn.v_proj.weight.copy_(wv)
            layer.self_attn.o_proj.weight.copy_(block.attn.proj.weight)
            gate, up = block.mlp.fc.weight.split([ff, ff])
            layer.mlp.gate_proj.weight.copy_(gate)
            layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(block.mlp.proj.weight)
            layer.input_layernorm.weight.copy_(block.ln1.weight)
            layer.post_attention_layernorm.weight.copy_(block.ln2.weight)


@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": False, "n_kv_head": 1},
                                   {"rope_scaling": RopeScaling(factor=8.0, original_max_position=16)}])
def test_hf_llama_of_the_same_shape_computes_the_same_logits(extra):
    cfg = ModelConfig(**{**SHAPE, **extra})
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    hf = llama_baseline.HFLlama(cfg, cfg.seq_len).eval()
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours)
    copy_into_hf(ours, hf.model, cfg)
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf.model(input_ids=idx).logits, ours(idx), atol=2e-5, rtol=1e-4)
        assert hf(idx, idx).item() == pytest.approx(ours(idx, idx).item(), rel=1e-5)


def test_non_llama_shapes_are_refused():
    with pytest.raises(ValueError, match="position=rope"):
        llama_baseline.HFLlama(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, seq_len=8), 8)
