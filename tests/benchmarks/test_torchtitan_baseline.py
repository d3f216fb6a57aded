"""benchmarks/torchtitan_baseline.py builds torchtitan's llama3 of the recipe's shape, and it is the
same model as megatrain's Llama: with megatrain's weights copied over (q and k rows reordered for
torchtitan's interleaved RoPE) both give the same logits, with and without Llama 3's RoPE scaling,
tied and untied. torchtitan imports triton at import time, so this runs where triton is (the GPU
image, with the ``peers`` extra's wheels); on CUDA the compiled peer's loss is checked too."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatrain.config.model import ModelConfig, RopeScaling  # noqa: E402
from megatrain.model import GPT, count_parameters  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, seq_len=32, position="rope",
             rope_theta=500000.0, norm="rmsnorm", mlp="swiglu", bias=False, block="serial")


def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from rotate-half RoPE order (megatrain, HF) to interleaved pairs (torchtitan)."""
    hd = w.shape[0] // heads
    return w.view(heads, 2, hd // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def copy_into_titan(ours: GPT, titan: torch.nn.Module, cfg: ModelConfig) -> None:
    q, kv, ff = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_dim
    with torch.no_grad():
        titan.tok_embeddings.weight.copy_(ours.embed.wte.weight)
        titan.norm.weight.copy_(ours.head.ln_f.weight)
        if not cfg.tie_embeddings:
            titan.output.weight.copy_(ours.head.weight)
        for block, layer in zip(ours.blocks, titan.layers.values()):
            wq, wk, wv = block.attn.qkv.weight.split([q, kv, kv])
            layer.attention.wq.weight.copy_(interleaved(wq, cfg.n_head))
            layer.attention.wk.weight.copy_(interleaved(wk, cfg.kv_heads))
            layer.attention.wv.weight.copy_(wv)
            layer.attention.wo.weight.copy_(block.attn.proj.weight)
            gate, up = block.mlp.fc.weight.split([ff, ff])
            layer.feed_forward.w1.weight.copy_(gate)
            layer.feed_forward.w3.weight.copy_(up)
            layer.feed_forward.w2.weight.copy_(block.mlp.proj.weight)
            layer.attention_norm.weight.copy_(block.ln1.weight)
            layer.ffn_norm.weight.copy_(block.ln2.weight)


@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": False, "n_kv_head": 1},
                                   {"rope_scaling": RopeScaling(factor=8.0, original_max_position=16)}])
def test_torchtitan_llama_of_the_same_shape_computes_the_same_logits(extra, monkeypatch):
    pytest.importorskip("triton")
    import torch._inductor.config

    # inductor compiles in this process: a pool of compile workers would outlive the test (the
    # leftover check names them), and shutting it down mid-session left the next compile waiting
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    import torchtitan_baseline

    cfg = ModelConfig(**{**SHAPE, **extra})
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    peer = torchtitan_baseline.TitanLlama(cfg, cfg.seq_len).eval()
    assert sum(p.numel() for p in peer.parameters()) == count_parameters(ours)
    copy_into_titan(ours, peer.model, cfg)
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(peer.model(idx), ours(idx), atol=2e-5, rtol=1e-4)
        assert peer(idx, idx).item() == pytest.approx(ours(idx, idx).item(), rel=1e-5)
    if torch.cuda.is_available():  # the peer as mfu.py runs it: compiled block by block, under bf16 autocast
        peer = peer.cuda().compile_like_torchtitan()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            assert peer(idx.cuda(), idx.cuda()).item() == pytest.approx(ours(idx, idx).item(), rel=2e-2)


def test_a_width_torchtitan_cannot_reach_is_refused():
    pytest.importorskip("triton")
    import torchtitan_baseline

    with pytest.raises(ValueError, match="biases"):
        torchtitan_baseline.TitanLlama(ModelConfig(**{**SHAPE, "bias": True}), 32)
