"""Precision, applied from outside the model (torchtitan style): the model is built in plain
PyTorch, then ``apply_precision`` swaps the transformer blocks' linears for FP8 ones when the
config asks for it. ``check_precision_supported`` runs before any model is built, so a machine
that cannot run FP8 fails at once with the reason, not with a ``_scaled_mm`` error mid-step.

- ``fp8.py``: torchao float8 training: which linears convert, the recipe, the hardware check;
- ``fp8_casts.py``: who casts the activations (``train.fp8.casts``): once per activation, shared;
- ``guard.py``: FP8 health of the converted weights (amax, underflow) for metrics and anomalies.
"""

from megatrain.precision.fp8 import apply_precision, check_precision_supported, fp8_linears, fp8_plan
from megatrain.precision.guard import FP8Guard

__all__ = ["FP8Guard", "apply_precision", "check_precision_supported", "fp8_linears", "fp8_plan"]
