"""The Llama baseline of ``benchmarks/mfu.py``: Hugging Face's ``LlamaForCausalLM`` built from a
config of the recipe's shape, as a user would set it up (SDPA attention, fp32 weights under bf16
autocast, fused AdamW and ``torch.compile`` of the whole model, by mfu.py's baseline loop in mfu_baseline.py).

``hf_llama_config`` translates a ``ModelConfig`` of the Llama family (RoPE + RMSNorm + SwiGLU,
any n_kv_head) into a ``LlamaConfig``: same layers, widths, heads, KV heads, vocabulary, RoPE
theta and Llama-3 scaling, norm epsilon, biases and tying. Hugging Face's Llama is the serial
block only; a recipe with the parallel block is compared against the serial HF model of the same
shape (same parameters and FLOPs per token). The loss is what ``labels=`` computes inside HF
(logits upcast to fp32, then ``F.cross_entropy``), applied to mfu.py's already shifted targets.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain.config import ModelConfig

LABEL = "baseline HF LlamaForCausalLM (SDPA) + torch.compile"


def is_llama_family(m: ModelConfig) -> bool:
    return m.position == "rope" and m.norm == "rmsnorm" and m.mlp == "swiglu"


def hf_llama_config(m: ModelConfig, seq_len: int):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        s = m.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}
    return LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads, head_dim=m.head_dim, hidden_act="silu",
        max_position_embeddings=max(seq_len, m.rope_scaling.original_max_position if m.rope_scaling else seq_len),
        rms_norm_eps=m.norm_eps, rope_parameters=rope, tie_word_embeddings=m.tie_embeddings,
        attention_bias=m.bias, mlp_bias=m.bias, initializer_range=m.init_std, use_cache=False,
        attn_implementation="sdpa",
    )


class HFLlama(nn.Module):
    """``forward(idx, targets) -> loss`` around ``LlamaForCausalLM`` (mfu.py's baseline contract)."""

    def __init__(self, m: ModelConfig, seq_len: int):
        super().__init__()
        from transformers import LlamaForCausalLM

        if not is_llama_family(m):
            raise ValueError("the HF Llama baseline needs model.position=rope, norm=rmsnorm, mlp=swiglu")
        self.model = LlamaForCausalLM(hf_llama_config(m, seq_len))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=idx, use_cache=False).logits  # [B, T, V]
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
