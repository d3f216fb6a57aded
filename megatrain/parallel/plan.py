"""The per-GPU memory plan of a recipe: ``megatrain plan configs/gpt-175b.yaml [--world-size N]``.

Everything is counted for the busiest GPU, one of the first pipeline stage: it holds the
embedding plus L/pp layers, and under 1F1B it keeps the activations of pp micro-batches alive
(micro-batch i's backward starts only after the warm-up forwards of the pp stages).

Model states (the ZeRO paper's accounting, Rajbhandari et al. 2020), P = parameters on this GPU:
  bf16 run: parameters 2P, gradients 2P, optimizer 12P (fp32 master copy + Adam/LAMB m and v)
  fp32 run: parameters 4P, gradients 4P, optimizer  8P (m and v)
  ZeRO-1 divides the optimizer term by dp, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

Activations per layer and micro-batch (Korthikanti et al. 2022, Table 2; 16-bit activations,
s = seq_len, b = micro-batch, h = d_model, a = heads, t = tp; the GPT's 10 and 24 become the
terms of ``activation_widths`` for GQA's smaller K/V and SwiGLU's gate and up):
  no recompute         TP: sbh (10 + 24/t + 5as/(ht))     TP+SP: sbh (34/t + 5as/(ht))
  selective recompute  TP: sbh (10 + 24/t)                TP+SP: sbh 34/t
  full recompute       each layer keeps only its input: 2sbh, or 2sbh/t when it is sequence-sharded
The formula describes a GPT layer with dropout masks and stored s x s attention scores; a
FlashAttention kernel stores no scores (selective-recompute numbers apply to "none" then), and
megatrain's parallel block without dropout stores somewhat less: the plan is an upper bound.
Recompute adds a working set: while one layer is recomputed for its backward pass, its
activations exist in full once (``recompute_working_bytes``). Not counted: the last stage's fp32
logits (4sbV/t per micro-batch, one micro-batch in flight there), communication buffers, the
allocator's fragmentation, and CUDA/NCCL context (~1-2 GiB).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from megatrain.config import Config
from megatrain.config import ConfigError, load_config

GIB = 1024**3


def activation_widths(cfg: Config) -> tuple[float, float]:
    """Bytes per token of one layer's stored activations, as (replicated, tensor-parallel-sharded)
    multiples of h, term by term (Korthikanti et al. 2022, generalised to GQA and SwiGLU):
      replicated: norm inputs 4h (two norms' worth, both blocks: an upper bound), the qkv input 2h,
                  the MLP input 2h, the attention and MLP dropout masks 1h + 1h           = 10h
      sharded:    q and k 2h + 2kv, v 2kv, the attention projection's input 2h,
                  MLP: GeLU 2ff (its input) + 2ff (proj input); SwiGLU 4ff (gate, up) + 2ff
    kv = n_kv_head * head_dim (h for multi-head); a GPT (kv = h, ff = 4h) gives 10h + 24h = 34h."""
    m = cfg.model
    h, kv, ff = m.d_model, m.kv_heads * m.head_dim, m.ffn_dim
    mlp_inner = 6 * ff if m.mlp == "swiglu" else 4 * ff
    return 10 * h, 4 * h + 4 * kv + mlp_inner


def activation_bytes_per_layer(cfg: Config, mode: str) -> float:
    """Korthikanti et al. (2022) bytes of one layer's activations for one micro-batch."""
    m, p = cfg.model, cfg.parallel
    s, b, h, a, t = cfg.seq_len, cfg.train.micro_batch_size, m.d_model, m.n_head, p.tp
    sp = p.sequence_parallel and t > 1
    attention_scores = 5 * a * s / (h * t)
    if mode == "full":
        return 2 * s * b * h / (t if sp else 1)
    replicated, sharded = activation_widths(cfg)
    base = (replicated + sharded) / (h * t) if sp else replicated / h + sharded / (h * t)
    return s * b * h * (base + (attention_scores if mode == "none" else 0.0))


def params_per_gpu(cfg: Config) -> int:
    """Parameters of one first-stage GPU: its share of L/pp layers, its 1/t of the token
    embedding, the whole position table (learned positions), and with pp = 1 the head too (final
    norm, an untied projection's 1/t). Column/row-parallel matrices and the qkv and fc biases are
    split by t; norms and the row-parallel biases are replicated. GQA: qkv is [d + 2kv, d];
    SwiGLU: fc is [2ff, d] (gate and up) beside proj [d, ff]."""
    m, t = cfg.model, cfg.parallel.tp
    d, ff, bias = m.d_model, m.ffn_dim, 1 if m.bias else 0
    kv = m.kv_heads * m.head_dim
    attention = (d + 2 * kv) * d // t + d * d // t + bias * ((d + 2 * kv) // t + d)
    fc_rows = 2 * ff if m.mlp == "swiglu" else ff
    mlp = fc_rows * d // t + ff * d // t + bias * (fc_rows // t + d)
    norm = d * (1 + (bias if m.norm == "layernorm" else 0))
    norms = (1 if m.block == "parallel" else 2) * norm
    layers = math.ceil(m.n_layer / cfg.parallel.pp)
    embedding = m.vocab_size * d // t + (m.seq_len * d if m.position == "learned" else 0)
    head = 0 if cfg.parallel.pp > 1 else norm + (0 if m.tie_embeddings else m.vocab_size * d // t)
    return layers * (attention + mlp + norms) + embedding + head


@dataclass
class MemoryPlan:
    name: str
    world_size: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    dtype: str  # bf16 or fp32
    layers_per_stage: int
    micro_batches_in_flight: int
    params: int  # parameters on this GPU
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    recompute: str  # the recipe's mode: none, selective or full
    activation_bytes: dict[str, float] = field(default_factory=dict)  # stored activations by mode
    recompute_working_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activation_bytes[self.recompute] + self.recompute_working_bytes)


def memory_plan(cfg: Config, world_size: int | None = None) -> MemoryPlan:
    """The plan for ``world_size`` GPUs (default: parallel.world_size, else tp*pp*dp with the
    recipe's dp, else one data-parallel replica)."""
    p = cfg.parallel
    if world_size is None:
        world_size = p.world_size or p.tp * p.pp * (p.dp or 1)
    dp = p.data_parallel_size(world_size)
    accumulation = cfg.train.grad_accumulation_steps(dp)
    bf16 = cfg.train.dtype in ("bf16", "auto")  # auto is bf16 on the GPUs this plan is for
    n = params_per_gpu(cfg)
    param_b, grad_b, optim_b = (2, 2, 12) if bf16 else (4, 4, 8)
    layers = math.ceil(cfg.model.n_layer / p.pp)
    in_flight = min(p.pp, accumulation)
    recompute = "full" if cfg.model.activation_checkpointing else "none"
    stored = {mode: layers * in_flight * activation_bytes_per_layer(cfg, mode) for mode in ("none", "selective", "full")}
    working = activation_bytes_per_layer(cfg, "none") - activation_bytes_per_layer(cfg, recompute)
    return MemoryPlan(
        name=cfg.name, world_size=world_size, dp=dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage,
        dtype="bf16" if bf16 else "fp32", layers_per_stage=layers, micro_batches_in_flight=in_flight, params=n,
        params_bytes=param_b * n / (dp if p.zero_stage >= 3 else 1),
        grads_bytes=grad_b * n / (dp if p.zero_stage >= 2 else 1),
        optimizer_bytes=optim_b * n / (dp if p.zero_stage >= 1 else 1),
        recompute=recompute, activation_bytes=stored, recompute_working_bytes=working,
    )


def format_plan(plan: MemoryPlan) -> str:
    def gib(x: float) -> str:
        return f"{x / GIB:10.2f}"

    optimizer_what = "fp32 master + m + v" if plan.dtype == "bf16" else "m + v"
    lines = [
        f"memory plan: {plan.name} (per GPU, first pipeline stage: embedding + {plan.layers_per_stage} layers)",
        f"layout: tp={plan.tp} pp={plan.pp} dp={plan.dp} (world {plan.world_size}), ZeRO-{plan.zero_stage}, "
        f"{plan.dtype}, {plan.micro_batches_in_flight} micro-batches in flight (1F1B)",
        f"parameters on this GPU: {plan.params:,} ({plan.params / 1e9:.2f} B)",
        "",
        f"{'item':<44}{'GiB':>10}",
        f"{'parameters (' + plan.dtype + ')':<44}{gib(plan.params_bytes)}",
        f"{'gradients (' + plan.dtype + ')':<44}{gib(plan.grads_bytes)}",
        f"{'optimizer (' + optimizer_what + ')':<44}{gib(plan.optimizer_bytes)}",
        f"{'activations, ' + plan.recompute + ' recompute':<44}{gib(plan.activation_bytes[plan.recompute])}",
        f"{'recompute working set (one layer)':<44}{gib(plan.recompute_working_bytes)}",
        f"{'total':<44}{gib(plan.total_bytes)}",
        "",
        "stored activations by recompute mode (Korthikanti et al. 2022):",
    ]
    for mode, value in plan.activation_bytes.items():
        mark = "  <- this recipe" if mode == plan.recompute else ""
        lines.append(f"  {mode:<42}{gib(value)}{mark}")
    return "\n".join(lines)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain plan", description="Print the per-GPU memory plan of a recipe.")
    parser.add_argument("config", help="a YAML recipe, e.g. configs/gpt-175b.yaml")
    parser.add_argument("--world-size", type=int, default=None, help="GPUs in the run (sets dp); default from the recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=4")
    args = parser.parse_args(argv)
    try:
        plan = memory_plan(load_config(args.config, args.overrides), args.world_size)
    except (ConfigError, ValueError) as exc:
        print(f"megatrain plan: {exc}")
        return 2
    print(format_plan(plan))
    return 0
