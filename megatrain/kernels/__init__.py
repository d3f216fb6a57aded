"""Hot ops, each as ``<op>_reference`` (plain torch, readable) beside ``<op>_fused`` (Triton, GPU).

``resolve(impl, device)`` turns a config choice (``auto``/``reference``/``fused``...) into the
implementation that will run, so the model never branches on hardware itself.
"""

from __future__ import annotations

import torch


def resolve(impl: str, x: torch.Tensor) -> str:
    """``auto`` means fused on CUDA when Triton imports, reference elsewhere."""
    if impl != "auto":
        return impl
    if x.is_cuda and triton_available():
        return "fused"
    return "reference"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
