"""A key/value cache for incremental decoding: ``model(idx, cache=cache)``.

The first call (the prompt) stores every layer's keys and values; each later call passes only the
new tokens, which attend to everything stored and append their own k, v. Positions continue at
``cache.length`` (RoPE rotates the new q and k there; a learned table reads rows from there on).
Keys are stored after RoPE, values as they are, with H_kv heads (GQA stores the small K/V).
Tensors grow by concatenation: simple, and the cost is small next to the model at the
lengths generation runs here. Training never passes a cache.
"""

from __future__ import annotations

import torch


class LayerKV:
    """One attention layer's cache: k, v [B, H_kv, length, hd]."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v [B, H_kv, T, hd]; return all keys and values so far."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v


class KVCache:
    def __init__(self, n_layer: int):
        self.layers = [LayerKV() for _ in range(n_layer)]

    @property
    def length(self) -> int:
        """Tokens seen so far (the position of the next token)."""
        return self.layers[0].length
