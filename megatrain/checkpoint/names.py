"""Canonical tensor names: a parameter's name in the plain GPT, whatever wraps it in this run.

A checkpoint's parameter map (reshard.py) keys everything by these names, so a restore finds a
tensor whatever wrappers wrote it or read it: a pipeline stage (DeepSpeed's PipelineModule numbers
its layers), activation checkpointing (``blocks.N.block.``), ``torch.compile`` (``_orig_mod.``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from megatrain.checkpoint import state


def canonical_name(name: str) -> str:
    """A GPT state-dict name without the wrappers parallelize() may add:
    ``blocks.0.block.attn.qkv.weight`` (activation checkpointing) -> ``blocks.0.attn.qkv.weight``."""
    name = name.replace("_orig_mod.", "")
    return re.sub(r"^(blocks\.\d+)\.block\.", r"\1.", name)


def _canonical(module: nn.Module, name: str) -> str:
    """The canonical name of ``name`` in a GPT or a DeepSpeed PipelineModule. A PipelineModule names
    its layers by their index in ``pipeline_layers()``: [Embedding (when tied: under
    ``tied_modules.embed``), blocks..., (the tied embedding again), LossHead]; under the document
    mask the untied embedding is ``EmbedDocuments`` and each block a ``BlockWithDocuments``."""
    from megatrain.model.gpt import Embedding
    from megatrain.parallel.pipeline import EmbedDocuments, LossHead

    if not hasattr(module, "forward_funcs"):
        return canonical_name(name)
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        return "embed." + rest.partition(".")[2]
    layer = module._modules[head]
    if isinstance(layer, Embedding):
        return "embed." + rest
    if isinstance(layer, EmbedDocuments):  # the document mask's first layer: "0.module.wte.weight"
        return "embed." + rest.partition(".")[2]
    if isinstance(layer, LossHead):
        return rest  # "head.ln_f.weight"
    return canonical_name(f"blocks.{int(head) - 1}.{rest}")


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Live state-dict name (as in the model file) -> canonical GPT name."""
    return {name: _canonical(module, name) for name in state.model_tensors(module)}


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> canonical name."""
    return {id(p): _canonical(module, name) for name, p in module.named_parameters()}


def live_names(tensors: dict[str, torch.Tensor], meta: dict[str, Any], module: nn.Module) -> dict[str, torch.Tensor]:
    """A model file's tensors under this run's live names (same layout; the wrappers may differ,
    e.g. activation checkpointing turned on). Files without a parameter map: GPT names."""
    saved = meta.get("shards", {}).get("names") or {name: canonical_name(name) for name in tensors}
    live = {canonical: name for name, canonical in canonical_names(module).items()}
    return {live.get(saved.get(name, name), name): tensor for name, tensor in tensors.items()}
