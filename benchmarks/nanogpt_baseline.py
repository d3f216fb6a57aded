"""The GPT baseline of ``benchmarks/mfu.py``: a nanoGPT-style GPT (serial pre-LN blocks, SDPA causal
attention, tanh GeLU MLP, tied LM head with full logits + ``F.cross_entropy``), written as a user
would write it. ``mfu_baseline.py`` runs it with fp32 weights under bf16 autocast, fused AdamW, a
global grad-norm clip and whole-model ``torch.compile``; a Llama recipe uses ``llama_baseline.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class NanoBlock(nn.Module):
    """nanoGPT's Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, d: int, n_head: int, ff: int, bias: bool, eps: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d, eps=eps, bias=bias)
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.ln_2 = nn.LayerNorm(d, eps=eps, bias=bias)
        self.c_fc = nn.Linear(d, ff, bias=bias)
        self.mlp_proj = nn.Linear(ff, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d: int, ff: int, bias: bool, eps: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(NanoBlock(d, n_head, ff, bias, eps) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, eps=eps, bias=bias)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
