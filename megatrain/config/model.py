"""The model's knobs: ``ModelConfig`` (a decoder-only transformer; a family is a choice of parts),
the kernel of each hot op and Llama 3's RoPE scaling. One section of ``megatrain.config.Config``
(``model:`` in a recipe), kept in its own module for its size; like ``megatrain.config`` this
imports neither torch nor prefect.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from megatrain.config.section import _Section


class KernelConfig(_Section):
    """Which implementation each hot op uses. ``reference`` is plain torch and runs everywhere;
    ``fused`` is Triton (GPU only); ``auto`` picks fused on CUDA and reference elsewhere."""

    layernorm: Literal["reference", "fused", "auto"] = "auto"
    gelu: Literal["reference", "fused", "auto"] = "auto"
    cross_entropy: Literal["reference", "chunked", "fused", "auto"] = "auto"
    # sdpa: torch scaled_dot_product_attention (flash/cuDNN on GPU); flex: FlexAttention block mask
    # (skips masked blocks of a sliding window); reference: explicit softmax(QK^T)V, for tests.
    attention: Literal["sdpa", "flex", "reference", "auto"] = "auto"
    # The Llama family's ops (model.norm=rmsnorm, model.mlp=swiglu, model.position=rope). Their
    # Triton kernels run in eager mode on CUDA; inside torch.compile ``auto`` leaves them to
    # inductor, which fuses the plain-torch ops with their neighbours.
    rmsnorm: Literal["reference", "fused", "auto"] = "auto"
    swiglu: Literal["reference", "fused", "auto"] = "auto"
    rope: Literal["reference", "fused", "auto"] = "auto"
    # The routed experts of model.mlp=moe (megatrain/model/moe_experts.py): reference = one GEMM
    # pair per expert in a Python loop; padded = each expert's tokens padded to the busiest one's
    # count, three batched matmuls; grouped = torch._grouped_mm over the token segments (Hopper,
    # bf16); auto = grouped on a CUDA device that has it, padded elsewhere.
    experts: Literal["reference", "padded", "grouped", "auto"] = "auto"
    # The MoE permutation (tokens to the experts' rows and back, megatrain/kernels/moe_permute.py):
    # reference = index ops; fused = Triton gathers, forward and backward (no atomics).
    moe_permute: Literal["reference", "fused", "auto"] = "auto"
    # The MoE router's selection (megatrain/kernels/moe_router.py): reference = torch.topk and a
    # scatter_add_ of the tokens per expert; fused = one Triton pass each, in registers.
    moe_router: Literal["reference", "fused", "auto"] = "auto"


class RopeScaling(_Section):
    """Llama 3's RoPE frequency scaling (Meta's ``apply_scaling``; Hugging Face's rope_type
    "llama3"): wavelengths shorter than original_max_position / high_freq_factor are kept,
    those longer than original_max_position / low_freq_factor are divided by ``factor``, and the
    band between is interpolated smoothly. Llama 3.1/3.2 use factor 32 (3.2) or 8 (3.1),
    low 1, high 4, original 8192. ``rope_type`` may be left out (older recipes): llama3."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(32.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position: int = Field(8192, gt=0)

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})")
        return self


class YarnScaling(_Section):
    """YaRN (Peng et al. 2023; Hugging Face's rope_type "yarn", ``_compute_yarn_parameters``):
    dimensions that turn more than ``beta_fast`` times over ``original_max_position`` keep their
    frequency, those turning fewer than ``beta_slow`` times are divided by ``factor``, a linear ramp
    between (over dimension indices, rounded outwards unless ``truncate`` false); cos and sin are
    multiplied by the attention factor: ``attention_factor``, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set, else 0.1 ln(factor) + 1 (1 for factor <= 1)."""

    rope_type: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0, description="context extension: new length / original_max_position")
    original_max_position: int = Field(gt=0, description="the context the model was trained at before")
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    attention_factor: float | None = Field(None, gt=0, description="None: derived from factor (and mscale)")
    mscale: float | None = Field(None, description="DeepSeek's mscale (with mscale_all_dim)")
    mscale_all_dim: float | None = None
    truncate: bool = Field(True, description="round the ramp's ends to whole dimensions (transformers' default)")

    @model_validator(mode="after")
    def _check(self) -> YarnScaling:
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})")
        return self

    @property
    def attention_scale(self) -> float:
        """The factor cos and sin are multiplied by (transformers' ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor

        def get(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if self.mscale and self.mscale_all_dim:
            return get(self.factor, self.mscale) / get(self.factor, self.mscale_all_dim)
        return get(self.factor)


def _rope_type(value: object) -> str:
    """The tag of a rope_scaling value; an untagged dict (recipes before YaRN) is Llama 3's."""
    if isinstance(value, dict):
        return value.get("rope_type", "llama3")
    return getattr(value, "rope_type", "llama3")


RopeScalingChoice = Annotated[Union[Annotated[RopeScaling, Tag("llama3")], Annotated[YarnScaling, Tag("yarn")]],
                              Discriminator(_rope_type)]


class CheckpointingPolicy(_Section):
    """What a block keeps for backward (applied from outside the model, parallel/parallelize.py):
    none keeps every activation; full recomputes every block; selective recomputes attention only
    (its [B, H, T, hd] projections and softmax statistics, the part that grows with seq_len);
    every_n recomputes blocks 0, n, 2n, ... (every n-th). ``true``/``false`` read as full/none."""

    policy: Literal["none", "full", "selective", "every_n"] = "none"
    n: int = Field(1, gt=0, description="every_n: one block in n is recomputed")

    @model_validator(mode="before")
    @classmethod
    def _from_bool_or_name(cls, value: object) -> object:
        if isinstance(value, bool):
            return {"policy": "full" if value else "none"}
        if isinstance(value, str):
            return {"policy": value}
        return value

    def __bool__(self) -> bool:  # "is anything recomputed", for callers that asked the old bool
        return self.policy != "none"

    def recomputed(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is recomputed whole (full, every_n)."""
        return self.policy == "full" or (self.policy == "every_n" and layer % self.n == 0)


class MoEConfig(_Section):
    """The routed feed-forward of ``model.mlp: moe`` (``megatrain/model/moe.py``): each token goes
    to its ``top_k`` of ``n_experts`` SwiGLU experts (dropless: no capacity, no token dropped),
    plus ``n_shared_experts`` that every token passes through (DeepSeek-V3, Qwen2-MoE). Defaults:
    8 experts, top-2, softmax scores, every layer routed, a 0.01 load-balancing loss (Mixtral-like).
    OLMoE: 64 experts, top-8, no shared expert, norm_topk_prob false, aux loss 0.01, z-loss 0.001.
    DeepSeek-V3: 256 experts, top-8, 1 shared, sigmoid, aux_free at rate 0.001, 3 dense layers."""

    n_experts: int = Field(8, gt=0, description="routed experts per MoE layer")
    top_k: int = Field(2, gt=0, description="routed experts each token uses")
    n_shared_experts: int = Field(0, ge=0, description="always-on experts: one SwiGLU of width n * expert_d_ff")
    expert_d_ff: int | None = Field(None, gt=0, description="each expert's hidden width; None = model.ffn_dim")
    router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="softmax over the experts (Mixtral, OLMoE, Qwen3) or a sigmoid per expert (DeepSeek-V3)"
    )
    norm_topk_prob: bool = Field(True, description="renormalise the top-k scores to sum to 1 (false: OLMoE)")
    moe_every: int = Field(1, gt=0, description="layer i is routed when (i + 1) % moe_every == 0; dense SwiGLU between")
    dense_layers: int = Field(0, ge=0, description="the first k layers stay dense SwiGLU (DeepSeek-V3: 3)")
    load_balance: Literal["aux_loss", "aux_free", "none"] = Field(
        "aux_loss", description="aux_loss: Switch/GShard's n_experts * sum_i f_i P_i times aux_loss_coef; "
        "aux_free: DeepSeek-V3's per-expert bias, added to the scores for the choice of experts only, moved by "
        "bias_update_rate towards balance after every optimizer step",
    )
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss (load_balance aux_loss)")
    bias_update_rate: float = Field(1e-3, ge=0, description="aux_free: bias step per optimizer step (DeepSeek-V3: 0.001)")
    z_loss_coef: float = Field(0.0, ge=0, description="router z-loss weight, mean logsumexp(logits)^2 (ST-MoE: 0.001)")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        return self


class ModelConfig(_Section):
    """A decoder-only transformer. The defaults are a small GPT-2-style model (learned positions,
    LayerNorm, GeLU, multi-head attention with biases); a family is a choice of the parts below,
    e.g. Llama = position rope + norm rmsnorm + mlp swiglu + n_kv_head < n_head + bias false
    (``configs/llama-*.yaml``), with MegaScale's parallel block or the serial one."""

    vocab_size: int = Field(50304, gt=0, description="rows of the embedding (pad to a multiple of 64)")
    n_layer: int = Field(12, gt=0)
    n_head: int = Field(12, gt=0)
    n_kv_head: int | None = Field(
        None, gt=0, description="key/value heads: None or n_head = multi-head, 1 = multi-query, between = "
        "grouped-query (each KV head serves n_head / n_kv_head query heads)",
    )
    d_model: int = Field(768, gt=0)
    d_ff: int | None = Field(
        None, gt=0, description="MLP hidden size; default 4 * d_model for gelu, Llama's rounding for swiglu "
        "(2/3 of 4 * d_model, times ffn_multiplier, rounded up to a multiple of ffn_multiple_of)",
    )
    ffn_multiplier: float = Field(1.0, gt=0, description="swiglu without d_ff: Llama's ffn_dim_multiplier")
    ffn_multiple_of: int = Field(256, gt=0, description="swiglu without d_ff: Llama's multiple_of")
    position: Literal["learned", "rope"] = Field(
        "learned", description="learned: a [seq_len, d] table added to the token embedding (GPT-2); rope: "
        "rotary embeddings applied to q and k in every layer (no table; Hugging Face's rotate-half layout)",
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (Llama 3: 500000)")
    rope_scaling: RopeScalingChoice | None = Field(
        None, description="{rope_type: llama3, ...} (Llama 3's frequency scaling; the default tag) or {rope_type: yarn, ...} (YaRN); None = plain RoPE")
    norm: Literal["layernorm", "rmsnorm"] = Field(
        "layernorm", description="layernorm (with a bias when model.bias) or rmsnorm (a gain only)"
    )
    mlp: Literal["gelu", "swiglu", "moe"] = Field(
        "gelu", description="gelu: proj(gelu(fc(x))); swiglu: proj(silu(gate(x)) * up(x)), three matrices; "
        "moe: routed SwiGLU experts (model.moe), dense SwiGLU in the layers it leaves dense",
    )
    moe: MoEConfig = Field(MoEConfig(), description="the experts and router of mlp moe")
    seq_len: int = Field(1024, gt=0, description="tokens per sample the model is trained on")
    block: Literal["parallel", "serial"] = Field(
        "parallel", description="parallel: x + attn(ln(x)) + mlp(ln(x)) (MegaScale/PaLM); serial: pre-LN"
    )
    attention: Literal["full", "sliding"] = "full"
    attention_mask: Literal["causal", "document"] = Field(
        "causal", description="causal: a token sees every earlier token of its packed sample; document: only "
        "those of its own document (documents end at the data's EOS; positions are not reset per document)",
    )
    window: int | None = Field(None, gt=0, description="sliding-window size in tokens (attention=sliding)")
    bias: bool = Field(True, description="biases in every linear and LayerNorm (GPT-2); Llama has none")
    tie_embeddings: bool = Field(True, description="the LM head reuses the token embedding matrix")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of LayerNorm / RMSNorm (Llama 3: 1e-5)")
    init_std: float = Field(0.02, gt=0)
    kernels: KernelConfig = KernelConfig()
    activation_checkpointing: CheckpointingPolicy = Field(
        CheckpointingPolicy(), description="none | full | selective | every_n ({policy: every_n, n: 2}); true = full")
    compile: bool = Field(False, description="wrap the model in torch.compile (GPU recipes)")

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width (for swiglu: of each of gate and up)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        hidden = int(self.ffn_multiplier * int(2 * 4 * self.d_model / 3))  # Llama's FeedForward
        return self.ffn_multiple_of * -(-hidden // self.ffn_multiple_of)

    @property
    def expert_ffn_dim(self) -> int:
        """Each routed expert's hidden width (model.moe.expert_d_ff, or ffn_dim)."""
        return self.moe.expert_d_ff or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has routed experts (see MoEConfig.moe_every, dense_layers)."""
        m = self.moe
        return self.mlp == "moe" and layer >= m.dense_layers and (layer + 1) % m.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layer))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_head, or n_head when unset)."""
        return self.n_kv_head or self.n_head

    @property
    def attended_context(self) -> int:
        """How many keys a query sees at most: seq_len, or the window when it is smaller."""
        if self.attention == "sliding" and self.window is not None:
            return min(self.window, self.seq_len)
        return self.seq_len

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"position rope needs an even head_dim (d_model / n_head = {self.head_dim})")
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError("rope_scaling: only with position 'rope'")
        if self.mlp != "moe" and self.moe != MoEConfig():
            raise ValueError(f"moe: set, but model.mlp is {self.mlp!r} (routed experts need mlp: moe)")
        if self.mlp == "moe" and self.n_moe_layers == 0:
            raise ValueError(f"moe: no layer of {self.n_layer} is routed (dense_layers {self.moe.dense_layers}, "
                             f"moe_every {self.moe.moe_every})")
        if self.attention == "sliding":
            if self.window is None:
                raise ValueError("window: required when attention is 'sliding'")
            if self.window > self.seq_len:
                raise ValueError(f"window ({self.window}) must be <= seq_len ({self.seq_len})")
        return self
