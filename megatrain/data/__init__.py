"""The data pipeline: text -> shards (``shard``), shards -> batches (``loader``, ``node_loader``).

Names are imported on first use: sharding workers and the CLI load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardIndex": "megatrain.data.index",
    "ShardInfo": "megatrain.data.index",
    "DataError": "megatrain.data.index",
    "BadShardError": "megatrain.data.index",
    "load_index": "megatrain.data.index",
    "shard_corpus": "megatrain.data.shard",
    "build_loader": "megatrain.data.loader",
    "ShardLoader": "megatrain.data.loader",
    "build_node_loader": "megatrain.data.node_loader",
    "NodeLoader": "megatrain.data.node_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
