"""Transformer blocks: MegaScale's parallel block and the classic serial pre-norm block, each built
from the configured parts (``norm.py``: LayerNorm or RMSNorm; ``attention.py``: MHA/GQA with
learned positions or RoPE; ``mlp.py``: GeLU or SwiGLU; ``moe.py``: routed experts in the layers
``model.moe`` routes). A plain Llama is the serial block with
RMSNorm, RoPE, GQA and SwiGLU; the parallel block composes with the same parts.

State-dict names: parallel ``ln``, ``attn.*``, ``mlp.*``; serial ``ln1``, ``attn.*``, ``ln2``,
``mlp.*`` (Hugging Face Llama: ``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``,
``mlp.*``; the part modules' docstrings map the rest).

``forward(x, cache=None)``: ``cache`` is this layer's ``LayerKV`` when decoding incrementally.

Each block has ``enter``/``exit`` slots (identity here). Tensor + sequence parallelism replaces
them from outside with all-gather / reduce-scatter regions; the parallel block needs one of each
per layer because attention and MLP read the same normalised input and their outputs are summed.

The parallel block can run its four projections as two matmuls (PaLM's fused formulation):
[qkv | fc] = h [W_qkv | W_fc]^T, and attn_proj(y) + mlp_proj(g) = [y | g] [W_attn_proj | W_mlp_proj]^T.
Same parameters, same math; bigger GEMMs (N = 3d + ff, then K = d + ff), and the attention
projection's small [d, d] GEMM disappears. It runs where ``FUSE_PROJECTIONS`` says, and only
while the block is plain (no tensor parallelism: its column/row-parallel linears and enter/exit
regions keep the unfused path). ``"compile"`` fuses inside ``torch.compile`` only, where
inductor writes the producers of the concatenated activations straight into one buffer (in
eager, the concatenations and the split's backward would each cost a copy of a
[tokens, 3d + ff] tensor).

Off by default: measured on one H200 (benchmarks/mfu.py, 1.3B, micro-batch 16, compiled
blocks, torch 2.11) the fused block was 1.3-2.6% SLOWER per step than the four projections.
cuBLAS runs the separate GEMMs at 690-700 TFLOP/s at these shapes already, so the bigger GEMMs
gain little, while the gradient of the fused input projection needs one [tokens, 3d + ff]
pointwise kernel (dq, dk, dv transposed in, GeLU backward) that inductor runs at about half the
copy bandwidth (1.0-1.2 ms per layer), plus a bias-gradient reduction over it.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain.config import ModelConfig
from megatrain.model.attention import Attention
from megatrain.model.cache import LayerKV
from megatrain.model.mlp import make_mlp
from megatrain.model.moe import MoE
from megatrain.model.norm import RMSNorm, make_norm

# When the parallel block fuses its projections: "never" (the default: measured slower, see the
# module docstring), "compile" (inside torch.compile only) or "always" (eager too; for tests).
# Read at call time.
FUSE_PROJECTIONS: Literal["compile", "always", "never"] = "never"
# The serial block hands its skip connection to a routed-experts layer, whose combine kernel adds it
# while writing the output (moe.py); False adds it here (benchmarks/mfu.py --variants residual-add).
MOE_TAKES_RESIDUAL = True
# A serial MoE block's first RMSNorm as a Triton kernel that also carries the skip connection, so
# its backward adds the two gradients while writing dx (kernels/rmsnorm.rms_norm_with_skip). Left to
# inductor, the layer's two norm backwards ran as two kernels that re-read their inputs: on
# moe-gpu-2b (one H200, micro-batch 32) this is +0.48% tokens/s (benchmarks/results/mfu-moe-2b-variant-norm1-skip-h200.json;
# --variants norm1-inductor measures False). Dense blocks keep inductor's norm: not measured there.
NORM1_CARRIES_SKIP = True


class ParallelBlock(nn.Module):
    """y = x + attn(norm(x)) + mlp(norm(x)): one norm, attention and MLP side by side."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp = make_feed_forward(cfg, layer)
        self.enter = nn.Identity()
        self.exit = nn.Identity()

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        if cache is None and self._fuse_projections():
            return x + self.fused_projections(self.ln(x))
        h = self.enter(self.ln(x))
        return x + self.exit(self.attn(h, cache) + self.mlp(h))

    def _fuse_projections(self) -> bool:
        if FUSE_PROJECTIONS == "never" or (FUSE_PROJECTIONS == "compile" and not torch.compiler.is_compiling()):
            return False
        if isinstance(self.mlp, MoE):  # routed experts have no fc to fuse with qkv
            return False
        plain = (type(self.enter) is nn.Identity and type(self.exit) is nn.Identity
                 and all(type(m) is nn.Linear for m in (self.attn.qkv, self.attn.proj, self.mlp.fc, self.mlp.proj)))
        biases = [m.bias is None for m in (self.attn.qkv, self.attn.proj, self.mlp.fc, self.mlp.proj)]
        return plain and len(set(biases)) == 1

    def fused_projections(self, h: torch.Tensor) -> torch.Tensor:
        """attn(h) + mlp(h) with two matmuls instead of four (see the module docstring)."""
        # [3d + ff] below reads [(H + 2G) hd + ff] with GQA and [.. + 2 ff] with SwiGLU
        attn, mlp = self.attn, self.mlp
        w_in = torch.cat([attn.qkv.weight, mlp.fc.weight])  # [3d + ff, d]
        b_in = None if attn.qkv.bias is None else torch.cat([attn.qkv.bias, mlp.fc.bias])
        qkv, pre = F.linear(h, w_in, b_in).split([attn.qkv.out_features, mlp.fc.out_features], dim=-1)
        y = torch.cat([attn.attend(qkv), mlp.activate(pre, None)], dim=-1)  # [B, T, d + ff]
        w_out = torch.cat([attn.proj.weight, mlp.proj.weight], dim=1)  # [d, d + ff]
        b_out = None if attn.proj.bias is None else attn.proj.bias + mlp.proj.bias
        return F.linear(y, w_out, b_out)


class SerialBlock(nn.Module):
    """x = x + attn(ln1(x)); x = x + mlp(ln2(x)) (GPT-2 / nanoGPT / Llama pre-norm)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = make_feed_forward(cfg, layer)
        self.enter_attn, self.exit_attn = nn.Identity(), nn.Identity()
        self.enter_mlp, self.exit_mlp = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        if NORM1_CARRIES_SKIP and isinstance(self.ln1, RMSNorm) and isinstance(self.mlp, MoE):
            h, x = self.ln1.with_skip(x)
        else:
            h = self.ln1(x)
        x = x + self.exit_attn(self.attn(self.enter_attn(h), cache))
        h = self.enter_mlp(self.ln2(x))
        if MOE_TAKES_RESIDUAL and isinstance(self.mlp, MoE) and type(self.exit_mlp) is nn.Identity:
            return self.mlp(h, residual=x)  # x + moe(h), the sum written by the combine kernel
        return x + self.exit_mlp(self.mlp(h))


def make_feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """Block ``layer``'s feed-forward: routed experts where ``cfg.is_moe_layer(layer)``, else dense."""
    return MoE(cfg, layer) if cfg.is_moe_layer(layer) else make_mlp(cfg)


def make_block(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    return ParallelBlock(cfg, layer) if cfg.block == "parallel" else SerialBlock(cfg, layer)
