"""The second Llama peer of ``benchmarks/mfu.py``: torchtitan's llama3 ``Transformer`` (the
``torchtitan`` package, 0.2.2: the ``peers`` extra of pyproject.toml, a benchmark-only dependency)
at the recipe's shape, set up as torchtitan's trainer sets it up on one GPU:

- each ``TransformerBlock`` compiled on its own with ``fullgraph=True`` (torchtitan's
  ``apply_compile``), and the loss compiled apart (its default ``compile.components``: model, loss);
- fp32 weights under bf16 autocast (its mixed precision without FSDP, ``maybe_enable_amp``);
- SDPA causal attention (llama3's ``attn_type="sdpa"``; cuDNN, then flash, first), no activation
  checkpointing (``activation_checkpoint.mode="none"``: on one H200 the step fits without it, and
  recomputing would only slow the peer down);
- the loss as torchtitan's ``cross_entropy_loss`` computes it (logits upcast to fp32), a mean here.

``titan_args`` translates a Llama-family ``ModelConfig``: layers, width, heads, KV heads, vocabulary,
RoPE theta and Llama-3 scaling, norm epsilon; the SwiGLU width is reached through torchtitan's own
``multiple_of`` / ``ffn_dim_multiplier`` rule and checked on the built model. torchtitan 0.2.2's
llama3 has no weight tying; a tied recipe ties ``output`` to ``tok_embeddings`` here (the same
parameters and FLOPs as megatrain's), initialised as torchtitan initialises its output layer.
torchtitan imports triton at import time, so this peer runs only where triton is (the GPU image).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain.config import ModelConfig

LABEL = "baseline torchtitan llama3 (SDPA) + per-block compile"


def titan_args(m: ModelConfig, seq_len: int):
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    if m.bias:
        raise ValueError("torchtitan's llama3 has no biases: the peer needs model.bias=false")
    base = int(2 * 4 * m.d_model / 3)  # FeedForward's hidden width before its multiplier
    # torchtitan 0.2.2 always applies Llama 3's frequency scaling; factor 1 leaves the frequencies as they are
    scaling = RoPEScalingArgs(scaling_factor=1.0)
    if m.rope_scaling is not None:
        s = m.rope_scaling
        scaling = RoPEScalingArgs(scaling_factor=s.factor, low_freq_factor=s.low_freq_factor,
                                  high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position)
    return TransformerModelArgs(
        dim=m.d_model, n_layers=m.n_layer, n_heads=m.n_head, n_kv_heads=m.kv_heads, vocab_size=m.vocab_size,
        multiple_of=min(256, m.ffn_dim & -m.ffn_dim),  # a power of two that divides the width
        ffn_dim_multiplier=m.ffn_dim / base, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        rope_scaling_args=scaling, max_seq_len=seq_len, attn_type="sdpa", attn_mask_type="causal",
    )


def titan_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy (fp32 logits), as a mean over the micro-batch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class TitanLlama(nn.Module):
    """``forward(idx, targets) -> loss`` around torchtitan's llama3 ``Transformer`` (mfu.py's
    baseline contract). ``compile_like_torchtitan`` applies torchtitan's compile; mfu_baseline.py
    calls it instead of compiling the whole model."""

    def __init__(self, m: ModelConfig, seq_len: int):
        super().__init__()
        from llama_baseline import is_llama_family
        from torchtitan.models.llama3.model.model import Transformer

        if not is_llama_family(m):
            raise ValueError("the torchtitan peer needs model.position=rope, norm=rmsnorm, mlp=swiglu")
        self.model = Transformer(titan_args(m, seq_len))
        with torch.no_grad():  # as torchtitan's trainer calls it
            self.model.init_weights()
            if m.tie_embeddings:
                out = self.model.output
                out.weight = self.model.tok_embeddings.weight
                s = m.d_model ** -0.5  # torchtitan's init of its output layer, kept for the tied weight
                nn.init.trunc_normal_(out.weight, std=s, a=-3 * s, b=3 * s)
        width = self.model.layers["0"].feed_forward.w1.out_features
        if width != m.ffn_dim:
            raise ValueError(f"torchtitan's FeedForward came out {width} wide, the recipe's model.ffn_dim is {m.ffn_dim}")
        self.loss_fn = titan_loss

    def compile_like_torchtitan(self) -> "TitanLlama":
        for layer_id, block in self.model.layers.named_children():
            self.model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))
        self.loss_fn = torch.compile(titan_loss)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)  # [B, T, V]
        return self.loss_fn(logits, targets)
