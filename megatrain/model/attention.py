"""Causal self-attention: multi-head, grouped-query (n_kv_head < n_head) or multi-query
(n_kv_head = 1); full or sliding window; learned positions (nothing to do here) or RoPE on q and k.

State-dict names (H = n_head, G = n_kv_head, hd = head_dim, d = d_model):
- ``qkv.weight`` [(H + 2G) hd, d]: rows [0, H hd) are q (head h in rows h hd .. (h+1) hd - 1),
  rows [H hd, (H + G) hd) are k, the last G hd rows are v (KV head g likewise). Hugging Face
  Llama: ``q_proj``, ``k_proj``, ``v_proj`` stacked in that order (RoPE in the same rotate-half
  layout, so no permutation). GPT-2's ``c_attn`` is the same with G = H.
- ``qkv.bias`` [(H + 2G) hd] when ``model.bias``; ``proj.weight`` [d, H hd] (HF ``o_proj``),
  ``proj.bias`` [d] when ``model.bias``.

Under tensor parallelism each rank holds H/t query heads and G/t KV heads: qkv is sharded block
by block ([q_r | k_r | v_r], ``parallel/tensor_parallel.py``), so the head counts are read from
the projection's width at run time.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.attention import attention_at_offset, causal_attention
from megatrain.kernels.rope import qkv_rope, split_qkv
from megatrain.model.cache import LayerKV
from megatrain.model.position import RotaryEmbedding
from megatrain.model.sequence import Sequence


# Where the rotated q and k are stored, inside compiled blocks. SDPA's cuDNN and flash kernels give
# their output (and q's gradient) the memory layout of q: rotated q stored [B, H, T, hd] (Inductor's
# choice for the rotation's output) makes the output [B, H, T, hd] too, and turning it back into
# [B, T, H hd] for the output projection is a copy, forward and backward. Stored token-major
# ([B, T, H, hd], viewed as [B, H, T, hd]) the rotation writes that layout itself (Inductor fuses the
# layout into the rotation's kernel) and the way back is a view: moe-gpu-2b on an H200, micro-batch
# 32, 168,101 against 167,494 tokens/s (benchmarks/mfu.py --variants rope-head-major measures the
# old layout). Eager mode leaves q as it is: there the copy would be a kernel of its own.
ROPE_TOKEN_MAJOR = True
# Training with RoPE: the split of qkv, the rotation and the tokens-first layout as one pass
# (kernels/rope.qkv_rope; fused on CUDA, compiled or not, unless model.kernels.rope says
# reference), and its backward writing the projection's gradient in one pass. v is then its own
# tensor, so attention's backward keeps no qkv alive: moe-gpu-2b at micro-batch 32 on an H200 peaks
# at 100.4 against 103.4 GiB, at the same tokens/s (182,779 against 182,881 with this off, which
# leaves it to inductor; benchmarks/RESULTS.md).
QKV_ROPE_ONE_PASS = True


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, hd] stored with T outside H: the same values, strides of a transposed [B, T, H, hd]."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_head // cfg.kv_heads  # query heads per KV head
        self.window = cfg.window if cfg.attention == "sliding" else None
        self.impl = cfg.kernels.attention
        self.rope = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        # Set by GPT.forward before the blocks run (and kept through the backward, whose activation
        # checkpointing recomputes this forward): positions, document ids, context-parallel attention.
        self.sequence: Sequence | None = None

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        return self.proj(self.attend(self.qkv(x), cache))

    def attend(self, qkv: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        """The part between the two projections: qkv [B, T, (H + 2G) hd] -> [B, T, H hd].
        ``qkv`` may be a strided view (the fused input projection of the parallel block)."""
        B, T, width = qkv.shape
        n_kv = width // ((self.group + 2) * self.head_dim)
        n_head = n_kv * self.group
        offset = 0 if cache is None else cache.length
        seq = self.sequence if cache is None else None
        positions = None if seq is None else seq.positions
        if self.rope is not None and cache is None and (QKV_ROPE_ONE_PASS or positions is not None):
            # a context-parallel rank's tokens sit at their global positions (two chunks, not 0 .. T-1);
            # positions are NOT reset per document (Llama 3's choice): a document starting mid-sample
            # is rotated by its place in the sample, the document mask alone separates documents.
            cos, sin = (self.rope.tables(T, 0, qkv.device) if positions is None
                        else (self.rope.cos[positions], self.rope.sin[positions]))
            q, k, v = qkv_rope(qkv, cos, sin, n_head, n_kv, self.head_dim, self.rope.impl)
        else:
            q, k, v = split_qkv(qkv, n_head, n_kv, self.head_dim)
            if self.rope is not None:
                q, k = self.rope(q, k, offset)
        # q [B, H, T, hd]; k, v [B, G, T, hd]
        if self.rope is not None and ROPE_TOKEN_MAJOR and torch.compiler.is_compiling():
            q, k = token_major(q), token_major(k)  # no copy where they are stored so already
        doc_ids = None if seq is None else seq.doc_ids
        if seq is not None and seq.attend is not None:
            y = seq.attend(q, k, v, self.window, doc_ids)  # across the context-parallel ranks
        elif cache is None:
            y = causal_attention(q, k, v, self.window, self.impl, doc_ids)  # [B, H, T, hd]
        else:
            k, v = cache.append(k, v)  # [B, G, offset + T, hd]
            y = attention_at_offset(q, k, v, offset, self.window)
        return y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)
