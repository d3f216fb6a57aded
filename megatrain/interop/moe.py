"""Mixture-of-experts models (``model.mlp: moe``) <-> ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
``Glm4MoeForCausalLM``: the tensor tables (see ``hf.py``); which class computes which megatrain
MoE, and config.json both ways, are in ``moe_config.py``.

megatrain stacks each MoE layer's experts (``model/moe_experts.py``): ``mlp.experts.fc``
[E, 2 ff, d] holds expert e's gate rows then its up rows, ``mlp.experts.proj`` [E, d, ff] its down
projection. Hugging Face checkpoints hold one tensor per expert and projection (transformers 5
fuses them in memory but saves and loads this layout, which older transformers and vLLM read):

    Mixtral      model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2 (gate / up / down), .gate
    Qwen2-MoE    model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj, mlp.gate
    GLM-4-MoE    the same names, plus mlp.gate.e_score_correction_bias and mlp.shared_experts.*

``PerExpert`` maps a stack to those tensors; ``RouterBias`` is megatrain's aux-free bias
(``mlp.router.bias``), which selects experts: GLM-4-MoE has it, and a class without one takes
only a zero bias (a non-zero one is refused at export). A dense layer between routed ones has
the Llama names (``mlp.gate_proj`` ...). Qwen2-MoE always builds a shared expert behind a sigmoid
gate; megatrain writes it zero wide (``ZeroWidth``), so it adds exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatrain.config import ModelConfig
from megatrain.interop.llama import _LLAMA_BLOCK, _LLAMA_GLOBALS
from megatrain.interop.mapping import (
    ExportRefused,
    Family,
    ImportMismatch,
    Rename,
    Split,
)
from megatrain.interop.moe_config import (
    GLM4_MOE,
    GLM4_MOE_DEFAULTS,
    MIXTRAL,
    MIXTRAL_DEFAULTS,
    MOE_NEUTRAL,
    QWEN2_MOE,
    QWEN2_MOE_DEFAULTS,
    glm4_moe_config,
    glm4_moe_model_config,
    mixtral_config,
    mixtral_model_config,
    moe_refusal,
    qwen2_moe_config,
    qwen2_moe_model_config,
)


@dataclass(frozen=True)
class PerExpert:
    """megatrain's stack ``ours`` [E, rows, cols] <-> one tensor per expert, or several split
    along the rows (``sizes(cfg)`` rows each, e.g. [gate | up]); ``{e}`` in ``theirs`` is the expert."""

    ours: str
    theirs: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]] | None = None

    def at_block(self, i: int) -> PerExpert:
        return PerExpert(self.ours.format(i=i), tuple(t.format(i=i, e="{e}") for t in self.theirs), self.sizes)

    def names(self, e: int) -> list[str]:
        return [t.format(e=e) for t in self.theirs]

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for e, tensor in enumerate(state[self.ours]):
            parts = tensor.split(self.sizes(cfg), dim=0) if self.sizes else (tensor,)
            out.update(zip(self.names(e), (p.contiguous() for p in parts), strict=True))
        return out

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        stack = []
        for e in range(cfg.moe.n_experts):
            for name in self.names(e):
                if name not in state:
                    raise ImportMismatch(f"the transformers checkpoint has no tensor {name!r} (needed for {self.ours})")
            stack.append(torch.cat([state[n] for n in self.names(e)], dim=0))
        return {self.ours: torch.stack(stack)}


@dataclass(frozen=True)
class RouterBias:
    """megatrain's aux-free bias [E]: GLM-4-MoE's ``e_score_correction_bias`` (``theirs``); where the
    class has none (``theirs`` None), exported only when zero (then routing is the class's) and
    imported as zeros. (Not a ``Rename``: the table drops names ending in .bias when model.bias is false.)"""

    ours: str
    architecture: str
    theirs: str | None = None

    def at_block(self, i: int) -> RouterBias:
        return RouterBias(self.ours.format(i=i), self.architecture, self.theirs and self.theirs.format(i=i))

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        bias = state[self.ours]
        if self.theirs:
            return {self.theirs: bias.float().contiguous()}
        if not bias.is_meta and bool(bias.any()):
            raise ExportRefused(f"{self.ours} is not zero: the aux-free bias steers which experts are chosen, and "
                                f"{self.architecture}'s router has none")
        return {}

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        if not self.theirs:
            return {self.ours: torch.zeros(cfg.moe.n_experts)}
        if self.theirs not in state:
            raise ImportMismatch(f"the transformers checkpoint has no tensor {self.theirs!r} (needed for {self.ours})")
        return {self.ours: state[self.theirs]}


@dataclass(frozen=True)
class ZeroWidth:
    """Hugging Face tensors with no megatrain counterpart that add exactly 0: Qwen2-MoE's shared
    expert of width 0 (gate, up [0, d], down [d, 0]) and its gate [1, d] (which scales those zeros)."""

    theirs: tuple[str, ...]
    shapes: Callable[[ModelConfig], tuple[tuple[int, ...], ...]]

    def at_block(self, i: int) -> ZeroWidth:
        return ZeroWidth(tuple(t.format(i=i) for t in self.theirs), self.shapes)

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape) for name, shape in zip(self.theirs, self.shapes(cfg), strict=True)}

    def from_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        return {}


def _expert_rows(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.expert_ffn_dim, cfg.expert_ffn_dim


def _shared_rows(cfg: ModelConfig) -> tuple[int, int]:
    width = cfg.moe.n_shared_experts * cfg.expert_ffn_dim
    return width, width


_ATTENTION = tuple(e for e in _LLAMA_BLOCK if ".mlp." not in e.ours)  # norms, qkv and the output projection
_DENSE = tuple(e for e in _LLAMA_BLOCK if ".mlp." in e.ours)  # gate/up/down of a dense layer
_ROUTER = "blocks.{i}.mlp.router.gate.weight"
_BIAS = "blocks.{i}.mlp.router.bias"


def _experts(prefix: str, gate: str, up: str, down: str) -> tuple[PerExpert, PerExpert]:
    return (PerExpert("blocks.{i}.mlp.experts.fc", (f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight"), _expert_rows),
            PerExpert("blocks.{i}.mlp.experts.proj", (f"{prefix}.{down}.weight",)))


_MIXTRAL_MOE = (
    Rename(_ROUTER, "model.layers.{i}.block_sparse_moe.gate.weight"),
    RouterBias(_BIAS, "MixtralForCausalLM"),
    *_experts("model.layers.{i}.block_sparse_moe.experts.{e}", "w1", "w3", "w2"),
)
_QWEN_EXPERTS = _experts("model.layers.{i}.mlp.experts.{e}", "gate_proj", "up_proj", "down_proj")
_QWEN2_MOE_MOE = (
    Rename(_ROUTER, "model.layers.{i}.mlp.gate.weight"),
    RouterBias(_BIAS, "Qwen2MoeForCausalLM"),
    *_QWEN_EXPERTS,
    ZeroWidth(tuple(f"model.layers.{{i}}.mlp.shared_expert{p}.weight" for p in (".gate_proj", ".up_proj", ".down_proj", "_gate")),
              lambda cfg: ((0, cfg.d_model), (0, cfg.d_model), (cfg.d_model, 0), (1, cfg.d_model))),
)
_GLM4_MOE_MOE = (
    Rename(_ROUTER, "model.layers.{i}.mlp.gate.weight"),
    RouterBias(_BIAS, "Glm4MoeForCausalLM", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    *_QWEN_EXPERTS,
)
_GLM4_SHARED = (
    Split("blocks.{i}.mlp.shared.fc.weight", ("model.layers.{i}.mlp.shared_experts.gate_proj.weight",
                                              "model.layers.{i}.mlp.shared_experts.up_proj.weight"), _shared_rows),
    Rename("blocks.{i}.mlp.shared.proj.weight", "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
)


def _layers(routed: tuple[Any, ...], shared: tuple[Any, ...] = ()) -> Callable[[ModelConfig, int], tuple[Any, ...]]:
    """Block i's table: attention, then the routed layer's (and shared experts') or the dense MLP's."""
    def table(cfg: ModelConfig, i: int) -> tuple[Any, ...]:
        if not cfg.is_moe_layer(i):
            return _ATTENTION + _DENSE
        return _ATTENTION + routed + (shared if cfg.moe.n_shared_experts else ())
    return table


_NOISE = "multiplicative noise on the router's input while transformers trains; the logits are the same"
_MTP = "the multi-token-prediction layers transformers does not build (nor megatrain): the logits are the same"
_ROTARY = {r"rotary_emb\.inv_freq$": "RoPE's frequencies, a buffer older transformers saved and recomputes"}

MIXTRAL_FAMILY = Family(
    name="mixtral", architecture="MixtralForCausalLM", model_type="mixtral", globals=_LLAMA_GLOBALS, per_block=(),
    layer_table=_layers(_MIXTRAL_MOE), refusal=lambda cfg: moe_refusal(cfg, MIXTRAL), hf_config=mixtral_config,
    model_config=mixtral_model_config, defaults=MIXTRAL_DEFAULTS, base_prefix="model.",
    neutral={**MOE_NEUTRAL, "router_jitter_noise": _NOISE}, ignored_tensors=_ROTARY,
)
QWEN2_MOE_FAMILY = Family(
    name="qwen2_moe", architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", globals=_LLAMA_GLOBALS, per_block=(),
    layer_table=_layers(_QWEN2_MOE_MOE), refusal=lambda cfg: moe_refusal(cfg, QWEN2_MOE), hf_config=qwen2_moe_config,
    model_config=qwen2_moe_model_config, defaults=QWEN2_MOE_DEFAULTS, base_prefix="model.", neutral=MOE_NEUTRAL,
    ignored_tensors=_ROTARY,
)
GLM4_MOE_FAMILY = Family(
    name="glm4_moe", architecture="Glm4MoeForCausalLM", model_type="glm4_moe", globals=_LLAMA_GLOBALS, per_block=(),
    layer_table=_layers(_GLM4_MOE_MOE, _GLM4_SHARED), refusal=lambda cfg: moe_refusal(cfg, GLM4_MOE),
    hf_config=glm4_moe_config, model_config=glm4_moe_model_config, defaults=GLM4_MOE_DEFAULTS, base_prefix="model.",
    neutral={"output_router_logits": MOE_NEUTRAL["output_router_logits"], "num_nextn_predict_layers": _MTP,
             "num_mtp_layers": _MTP},
    ignored_tensors=_ROTARY,
)
MOE_FAMILIES = (MIXTRAL_FAMILY, QWEN2_MOE_FAMILY, GLM4_MOE_FAMILY)
