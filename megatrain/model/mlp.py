"""The feed-forward part: GeLU (GPT-2; ``model.mlp=gelu``) or SwiGLU (Llama; ``model.mlp=swiglu``).

Both are ``proj(activate(fc(x)))`` with ff = ``model.ffn_dim``:
- GeLU: ``fc.weight`` [ff, d] (+ ``fc.bias`` [ff]), gelu(h + bias) in one kernel, ``proj.weight``
  [d, ff] (+ ``proj.bias`` [d]). Hugging Face GPT-2: ``c_fc`` / ``c_proj`` (transposed Conv1D).
- SwiGLU: ``fc.weight`` [2 ff, d] holds gate's rows then up's (one GEMM for both:
  Hugging Face Llama ``gate_proj`` = fc.weight[:ff], ``up_proj`` = fc.weight[ff:]), then
  silu(gate) * up, then ``proj.weight`` [d, ff] (HF ``down_proj``). Three matrices' worth of
  parameters; biases only with ``model.bias``.
Tensor parallelism shards fc by rows (SwiGLU: gate and up block by block, so each rank holds
matching halves) and proj by columns.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain.config import ModelConfig
from megatrain.kernels.gelu import bias_gelu
from megatrain.kernels.swiglu import swiglu


class MLP(nn.Module):
    """fc -> bias + GeLU (one fused op) -> proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.impl = cfg.kernels.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        h = F.linear(x, self.fc.weight)  # [B, T, ff]; bias goes into the GeLU kernel
        return self.proj(self.activate(h, self.fc.bias))

    def activate(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """gelu(h + bias), the part between the two projections."""
        return bias_gelu(h, bias, self.impl)


class SwiGLU(nn.Module):
    """fc = [gate | up] (one GEMM) -> silu(gate) * up -> proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.impl = cfg.kernels.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        return self.proj(self.activate(self.fc(x), None))

    def activate(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of h [B, T, 2 ff] (+ bias) -> [B, T, ff]."""
        return swiglu(h if bias is None else h + bias, self.impl)


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """The dense feed-forward (also of the layers ``model.mlp=moe`` leaves dense: SwiGLU)."""
    return MLP(cfg) if cfg.mlp == "gelu" else SwiGLU(cfg)
