"""A plain-PyTorch decoder-only transformer (GPT-2 and Llama families, MegaScale's choices); no
process groups inside."""

from megatrain.model.cache import KVCache
from megatrain.model.gpt import (
    GPT,
    active_parameter_count,
    count_parameters,
    expected_parameter_count,
    init_weights,
)

__all__ = ["GPT", "KVCache", "active_parameter_count", "count_parameters", "expected_parameter_count", "init_weights"]
