"""Hot ops, each as ``<op>_reference`` (plain torch, readable) beside ``<op>_fused`` (Triton, GPU).

``resolve(impl, device)`` turns a config choice (``auto``/``reference``/``fused``...) into the
implementation that will run, so the model never branches on hardware itself.

The Triton modules (``*_triton.py``, ``flex_attention.py``) are imported lazily by the dispatch
functions, so a CPU-only machine never imports Triton.
"""

from __future__ import annotations

import functools

import torch


def resolve(impl: str, x: torch.Tensor, under_compile: str | None = "reference") -> str:
    """``auto`` means fused on CUDA when Triton imports, reference elsewhere, and
    ``under_compile`` inside a region that ``torch.compile`` is tracing. For LayerNorm that is
    the reference: inductor fuses the plain-torch ops with their neighbours (the residual add)
    into kernels of its own, which a hand-written autograd Function would hide from it (the
    Triton LayerNorm inside compiled blocks measured 0.8% slower on an H200). ``None`` keeps
    the CUDA/CPU choice under compile too: the LM-head loss (whose reference materialises the
    logits) and bias + GeLU (whose Triton backward also reduces the bias gradient in one pass)."""
    if impl != "auto":
        return impl
    if under_compile is not None and torch.compiler.is_compiling():
        return under_compile
    if x.is_cuda and triton_available():
        return "fused"
    return "reference"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes persistent grids); 4 elsewhere, which is
    what the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) gets."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
