"""What the attention layers need to know about the tokens they see, beyond the tokens themselves:
where they sit in the whole sample and which document each belongs to.

Without context parallelism a rank sees whole samples: positions are 0 .. T - 1 and the document
ids, under ``model.attention_mask: document``, are computed from the tokens (``GPT.forward``).
Under context parallelism (``parallel/context_parallel.py``) a rank holds two chunks of every
sample: ``positions`` are their global positions (RoPE and learned positions read them),
``doc_ids`` were computed on the whole sample before it was cut, so they are global too, and
``attend`` is the attention across the ranks (ring or all-to-all), which replaces the local kernel.

The model never imports the parallel package: ``attend`` is handed in as a callable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Sequence:
    positions: Optional[torch.Tensor] = None  # [T] int64, the global position of each local token; None: 0 .. T-1
    doc_ids: Optional[torch.Tensor] = None  # [B, T] int32, global document ids; None: one document per sample
    # (q [B, H, T, hd], k, v [B, G, T, hd], window, doc_ids) -> [B, H, T, hd]; None: the local kernel
    attend: Optional[Callable] = None
