"""The decoder-only transformer: token (+ learned position) embedding -> n_layer blocks -> final
norm -> LM head (tied to the token embedding or not). GPT-2 and Llama are choices of parts in
``ModelConfig`` (position, norm, mlp, n_kv_head, bias, tie_embeddings, block), not two classes.

``GPT.layers()`` is the flat, ordered list [Embedding, Block x n_layer, Head] the pipeline slices;
everything the forward does is in those layers, in that order.

State-dict names: ``embed.wte.weight`` [V, d] (HF Llama ``model.embed_tokens.weight``),
``embed.wpe.weight`` [seq_len, d] (learned positions only), ``blocks.{i}.*`` (``block.py``),
``head.ln_f.*`` (HF ``model.norm``), and ``head.weight`` [V, d] when untied (HF ``lm_head.weight``).

``model(idx, cache=KVCache(n_layer))`` decodes incrementally (``cache.py``): logits for the new
tokens only, positions continuing after the cached ones.

``model(idx, targets, sequence=Sequence(...))`` trains on a context-parallel rank's chunks
(``sequence.py``). Under ``model.attention_mask: document`` without a sequence, the document ids
come from the tokens and ``eos_id`` (set from the data's tokenizer by whoever feeds the model).

Construction allocates and initialises; ``init_weights`` is separate so a model built under
``torch.device("meta")`` can be materialised (``to_empty``) and initialised later.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from megatrain.config import ModelConfig
from megatrain.kernels.attention import document_ids
from megatrain.kernels.cross_entropy import lm_head_cross_entropy
from megatrain.model.attention import Attention
from megatrain.model.block import make_block
from megatrain.model.cache import KVCache
from megatrain.model.moe_experts import Experts
from megatrain.model.norm import NORMS, make_norm
from megatrain.model.sequence import Sequence


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # learned positions; with RoPE the positions enter inside attention instead
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # The global positions [T] of the tokens this module embeds when none are passed: set from
        # outside for a pipeline stage under context parallelism, whose layers are called one by one
        # (GPT.forward, which passes a Sequence's positions, is not), like Attention.sequence.
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] int64 -> [B, T, d]; ``positions`` [T]: the tokens' global positions (context parallel)."""
        x = self.wte(idx)
        if self.wpe is not None:
            if positions is None and offset == 0:
                positions = self.positions
            if positions is None:
                positions = torch.arange(offset, offset + idx.shape[1], device=idx.device)
            x = x + self.wpe(positions)
        return self.drop(x)


class Head(nn.Module):
    """Final norm and the vocabulary projection (sharing the embedding matrix when tied)."""

    def __init__(self, cfg: ModelConfig, embedding: Embedding):
        super().__init__()
        self.ln_f = make_norm(cfg)
        self.tied = cfg.tie_embeddings
        # A tied head holds no weight of its own; it reads the embedding's at call time.
        self._embedding = [embedding]  # a list keeps it out of this module's parameters
        self.weight = None if self.tied else nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.ce_impl = cfg.kernels.cross_entropy

    def projection(self) -> torch.Tensor:  # [V, d]
        return self._embedding[0].wte.weight if self.tied else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> logits [B, T, V]
        return self.ln_f(x) @ self.projection().t()

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # -> scalar fp32
        h = self.ln_f(x)
        return lm_head_cross_entropy(h.flatten(0, 1), self.projection(), targets.flatten(), self.ce_impl)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(make_block(cfg, i) for i in range(cfg.n_layer))
        self.head = Head(cfg, self.embed)
        self.eos_id: int | None = None  # model.attention_mask document: the id that ends a document
        # a plain list (not submodules): the blocks' attention layers, found again under any wrapper
        self._attentions = [m for m in self.blocks.modules() if isinstance(m, Attention)]
        init_weights(self, cfg)

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                sequence: Sequence | None = None) -> torch.Tensor:
        """idx [B, T] -> logits [B, T, V], or the mean loss when targets [B, T] are given.
        With a ``cache``, idx are the tokens after the cached ones (see the module docstring)."""
        if sequence is None and cache is None and self.cfg.attention_mask == "document":
            if self.eos_id is None:
                raise ValueError("model.attention_mask=document: the model's eos_id is not set (the data's EOS id)")
            sequence = Sequence(doc_ids=document_ids(idx, self.eos_id))
        for attention in self._attentions:  # every forward sets it: a stale one would leak into the next call
            attention.sequence = sequence
        if cache is None:
            x = self.embed(idx, positions=None if sequence is None else sequence.positions)
            for block in self.blocks:
                x = block(x)
        else:
            x = self.embed(idx, cache.length)
            for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
                x = block(x, layer_cache)
        return self.head(x) if targets is None else self.head.loss(x, targets)


def init_weights(model: GPT, cfg: ModelConfig) -> None:
    """GPT-2 init (Llama's too): N(0, std) weights, zero biases, unit norm gains; the projections that
    write into the residual stream are scaled by 1/sqrt(2 * n_layer) so its variance stays flat."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith(".proj") else cfg.init_std
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
        elif isinstance(module, Experts):
            module.reset_parameters(cfg.init_std, residual_std)
        elif isinstance(module, NORMS):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    for name, buffer in model.named_buffers():  # the aux-free router biases (moe.py) start at zero
        if name.endswith("router.bias"):
            buffer.zero_()
    if model.head.weight is not None:
        nn.init.normal_(model.head.weight, mean=0.0, std=cfg.init_std)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_parameter_count(cfg: ModelConfig) -> int:
    """Parameters by formula (the tests hold the model to it)."""
    d, ff, L, V = cfg.d_model, cfg.ffn_dim, cfg.n_layer, cfg.vocab_size
    b = 1 if cfg.bias else 0
    kv = cfg.kv_heads * cfg.head_dim  # width of k and of v: d with multi-head attention
    norm = d * (1 + (b if cfg.norm == "layernorm" else 0))  # RMSNorm has a gain only
    attention = d * (d + 2 * kv) + d * d + b * (d + 2 * kv + d)  # qkv [d + 2kv, d] + proj [d, d] and biases
    mats = 2 if cfg.mlp == "gelu" else 3  # fc, proj / gate, up, down
    mlp = mats * d * ff + b * ((mats - 1) * ff + d)
    norms_per_block = 1 if cfg.block == "parallel" else 2
    per_block = attention + mlp + norms_per_block * norm
    embeddings = V * d + (cfg.seq_len * d if cfg.position == "learned" else 0)
    head = norm + (0 if cfg.tie_embeddings else V * d)
    routed = cfg.n_moe_layers * (moe_layer_parameters(cfg) - mlp)  # a MoE layer's feed-forward instead of the dense one
    return embeddings + L * per_block + head + routed


def moe_layer_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """One MoE layer's feed-forward: router [E, d], E (or top_k, ``active``) experts of 3 d eff,
    the shared experts' 3 d (n_s eff); no biases."""
    m, d, eff = cfg.moe, cfg.d_model, cfg.expert_ffn_dim
    return m.n_experts * d + (m.top_k if active else m.n_experts) * 3 * d * eff + 3 * d * m.n_shared_experts * eff


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token passes through (MoE: top_k of the routed experts; dense: all)."""
    inactive = cfg.n_moe_layers * (moe_layer_parameters(cfg) - moe_layer_parameters(cfg, active=True))
    return expected_parameter_count(cfg) - inactive
