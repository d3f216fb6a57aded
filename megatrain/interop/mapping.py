"""The vocabulary of the Hugging Face mapping tables (``gpt2.py``, ``llama.py``, ``neox.py``):
a ``Family`` is one transformers architecture, a table of entries that say how each megatrain
tensor becomes Hugging Face tensors and back, the config.json fields both ways, and the first
config field it cannot express (its refusal). ``HFConfig`` is a config.json as transformers reads
it, remembering which keys a family's mapping read, so that no key goes unmapped unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch

from megatrain.config import ModelConfig
from megatrain.errors import InputError


class ExportRefused(InputError):
    """The model's config has a field no Hugging Face architecture expresses exactly."""


class ImportMismatch(InputError):
    """A transformers checkpoint that megatrain cannot load exactly, or that differs from the recipe."""


class HFConfig(dict):
    """A config.json as transformers reads it. A key the file lacks has the default of that
    model type's transformers config class (``defaults``: a file of three keys is still a whole
    model to transformers). Every key a mapping reads is recorded in ``read``: the keys left
    unread are the ones nothing mapped, and ``hf_config.check_every_key`` refuses them."""

    def __init__(self, data: dict[str, Any], path: str, defaults: dict[str, Any] | None = None):
        super().__init__(data)
        self.path, self.defaults, self.read = path, dict(defaults or {}), set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        if key in self.defaults:
            return self.defaults[key]
        raise ImportMismatch(f"{self.path}: no {key!r} (and transformers has no default for it)")

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self.defaults.get(key, default)

    def refuse(self, key: str, why: str, value: Any = None) -> ImportMismatch:
        """The one-line refusal of ``key`` (or of ``value`` inside it): the file, the key and its value, why."""
        if value is not None or dict.__contains__(self, key):
            shown = repr(value if value is not None else dict.__getitem__(self, key))
        else:
            shown = f"{self.defaults.get(key)!r} (absent: transformers' default)"
        return ImportMismatch(f"{self.path}: {key}={shown}: {why}")


@dataclass(frozen=True)
class Rename:
    """One tensor, the same values on both sides; ``{i}`` is the block index. ``layout``: how the
    Hugging Face side arranges it, if not as megatrain does: "transpose" (GPT-2's Conv1D stores
    [in, out]) or "heads" (GPT-NeoX's fused qkv rows per head: [q_h | k_h | v_h] for each head h,
    where megatrain has [q | k | v])."""

    ours: str
    theirs: str
    layout: str | None = None


@dataclass(frozen=True)
class Copies:
    """One megatrain tensor written to several Hugging Face tensors (the parallel block's one
    norm into GPT-NeoX's two); importing requires them equal."""

    ours: str
    theirs: tuple[str, ...]


def _relayout(tensor: torch.Tensor, layout: str | None, cfg: ModelConfig, to_theirs: bool) -> torch.Tensor:
    if layout == "transpose":
        return tensor.t()
    if layout == "heads":  # [3, H, hd, ...] <-> [H, 3, hd, ...] along the rows
        shape = (3, cfg.n_head, cfg.head_dim) if to_theirs else (cfg.n_head, 3, cfg.head_dim)
        return tensor.reshape(*shape, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
    return tensor


@dataclass(frozen=True)
class Split:
    """One fused megatrain tensor, several Hugging Face tensors: ``ours`` is ``theirs``
    concatenated along dim 0 (rows), ``sizes(cfg)`` rows each (e.g. [q | k | v])."""

    ours: str
    theirs: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]


def field(cfg: ModelConfig, name: str, default: Any = None) -> Any:
    """A ModelConfig field that older configs may not have (the Llama knobs)."""
    return getattr(cfg, name, default)


def full_attention(cfg: ModelConfig) -> bool:
    """Sliding windows at least as long as the context are exactly full causal attention."""
    return cfg.attention == "full" or (cfg.window is not None and cfg.window >= cfg.seq_len)


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # the transformers class export targets
    model_type: str  # config.json's model_type this family imports
    globals: tuple[Rename, ...]
    per_block: tuple[Rename | Split | Copies, ...]
    refusal: Callable[[ModelConfig], str | None]  # "model.<field>=<value>: why" or None
    hf_config: Callable[[ModelConfig, int], dict[str, Any]]  # (cfg, eos id) -> config.json fields
    model_config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields
    imports: Callable[[dict[str, Any]], bool] = lambda hf: True  # among families of one model_type
    # transformers' config-class defaults of the keys model_config reads (a key absent from config.json)
    defaults: dict[str, Any] = dataclass_field(default_factory=dict)
    # keys of this architecture's config.json that change nothing megatrain computes: key -> why
    neutral: dict[str, str] = dataclass_field(default_factory=dict)
    # tensors a checkpoint may hold that transformers drops on loading (derived buffers): pattern -> why
    ignored_tensors: dict[str, str] = dataclass_field(default_factory=dict)
    base_prefix: str = ""  # the base model's prefix: a folder saved from the base model alone lacks it
    # the table of block i when blocks differ (a mixture of experts: routed or dense); None: per_block
    layer_table: Callable[[ModelConfig, int], tuple[Any, ...]] | None = None

    def entries(self, cfg: ModelConfig) -> list[Any]:
        """The table for one model: ``{i}`` filled in per block, absent tensors left out."""
        out: list[Any] = [r for r in self.globals if not cfg.tie_embeddings or r.ours != "head.weight"]
        for i in range(cfg.n_layer):
            for e in (self.per_block if self.layer_table is None else self.layer_table(cfg, i)):
                if hasattr(e, "at_block"):  # an entry that maps itself (moe.py's per-expert entries)
                    out.append(e.at_block(i))
                elif isinstance(e, Split):
                    out.append(Split(e.ours.format(i=i), tuple(t.format(i=i) for t in e.theirs), e.sizes))
                elif isinstance(e, Copies):
                    out.append(Copies(e.ours.format(i=i), tuple(t.format(i=i) for t in e.theirs)))
                else:
                    out.append(Rename(e.ours.format(i=i), e.theirs.format(i=i), e.layout))
        if not cfg.bias:  # then no linear or norm has one
            out = [e for e in out if hasattr(e, "to_hf") or not e.ours.endswith(".bias")]
        return out

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.entries(cfg):
            if hasattr(e, "to_hf"):
                out.update(e.to_hf(state, cfg))
                continue
            tensor = state[e.ours]
            if isinstance(e, Split):
                out.update(zip(e.theirs, (t.contiguous() for t in tensor.split(e.sizes(cfg), dim=0)), strict=True))
            elif isinstance(e, Copies):
                out.update((name, tensor.clone()) for name in e.theirs)
            else:
                out[e.theirs] = _relayout(tensor, e.layout, cfg, to_theirs=True).contiguous()
        return out

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for e in self.entries(cfg):
            if hasattr(e, "from_hf"):
                out.update(e.from_hf(state, cfg))
                continue
            names = e.theirs if isinstance(e, (Split, Copies)) else (e.theirs,)
            for name in names:
                if name not in state:
                    raise ImportMismatch(f"the transformers checkpoint has no tensor {name!r} (needed for {e.ours})")
            if isinstance(e, Split):
                out[e.ours] = torch.cat([state[n] for n in names], dim=0)
            elif isinstance(e, Copies):
                if not all(torch.equal(state[names[0]], state[n]) for n in names[1:]):
                    raise ImportMismatch(f"{' and '.join(names)} differ: megatrain's {e.ours} is one tensor for all of them")
                out[e.ours] = state[names[0]]
            else:
                out[e.ours] = _relayout(state[e.theirs], e.layout, cfg, to_theirs=False).contiguous()
        return out


def kv_heads(cfg: ModelConfig) -> int:
    return field(cfg, "n_kv_head") or cfg.n_head
