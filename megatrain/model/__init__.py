"""A plain-PyTorch GPT with MegaScale's algorithmic choices; no process groups inside."""

from megatrain.model.gpt import GPT, count_parameters, expected_parameter_count, init_weights

__all__ = ["GPT", "count_parameters", "expected_parameter_count", "init_weights"]
