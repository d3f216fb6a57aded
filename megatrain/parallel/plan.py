"""The per-GPU memory plan of a recipe: ``megatrain plan configs/gpt-175b.yaml [--world-size N]``,
and the size of one checkpoint (``checkpoint_size``: what the preflight asks the staging disk and
the durable store to hold twice, ``megatrain/reliability/preflight.py``).

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

Mixture of Experts (``model.mlp: moe``): every expert's weights, gradients and optimizer state
live on the GPU (with ``parallel.ep``, 1/ep of the routed experts), so the model states count those,
while a token's compute (and ``observe/mfu.py``) counts the active ones. A routed layer's
activations add, per token, the k dispatched copies of its input and the k experts' outputs
(2kh + 2kh), their gate/up and SwiGLU outputs (6k eff), the shared experts' (6 n_s eff) and the
router's fp32 logits and scores (8E); the plan counts every layer as routed (an upper bound when
some stay dense).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from megatrain.config import Config, ConfigError, ModelConfig, load_config
from megatrain.model.gpt import (
    active_parameter_count,
    expected_parameter_count,
    moe_layer_parameters,
)
from megatrain.parallel.plan_activations import ActivationPlan, plans_by_policy

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
    mlp_inner = 4 * ff if m.mlp == "gelu" else 6 * ff
    if m.mlp == "moe":  # see the module docstring
        k, eff = m.moe.top_k, m.expert_ffn_dim
        mlp_inner = 4 * k * h + 6 * k * eff + 6 * m.moe.n_shared_experts * eff + 8 * m.moe.n_experts
    return 10 * h, 4 * h + 4 * kv + mlp_inner


def activation_bytes_per_layer(cfg: Config, mode: str) -> float:
    """Korthikanti et al. (2022) bytes of one layer's activations for one micro-batch."""
    m, p = cfg.model, cfg.parallel
    # a context-parallel rank holds seq_len/cp tokens of each sample (the scores term then reads
    # its local s^2: ring attention stores none, see plan_activations.py for what it does store)
    s, b, h, a, t = cfg.seq_len / p.cp, cfg.train.micro_batch_size, m.d_model, m.n_head, p.tp
    sp = p.sequence_parallel and t > 1
    attention_scores = 5 * a * s / (h * t)
    if mode == "full":
        return 2 * s * b * h / (t if sp else 1)
    replicated, sharded = activation_widths(cfg)
    base = (replicated + sharded) / (h * t) if sp else replicated / h + sharded / (h * t)
    return s * b * h * (base + (attention_scores if mode == "none" else 0.0))


def routed_expert_parameters(m: ModelConfig, layers: int | None = None) -> int:
    """Parameters of the routed experts (E experts of gate, up and down, 3 d eff each) in
    ``layers`` MoE layers (default: every MoE layer of the model); 0 for a dense model. This is
    what expert parallelism cuts into ep slices and the rest of the model replicates."""
    if m.mlp != "moe":
        return 0
    return (m.n_moe_layers if layers is None else layers) * m.moe.n_experts * 3 * m.d_model * m.expert_ffn_dim


def params_per_gpu(cfg: Config, tp: int | None = None, pp: int | None = None, ep: int | None = None) -> int:
    """Parameters of one first-stage GPU: its share of L/pp layers, its 1/t of the token
    embedding, the whole position table (learned positions), and with pp = 1 the head too (final
    norm, an untied projection's 1/t). Column/row-parallel matrices and the qkv and fc biases are
    split by t; norms and the row-parallel biases are replicated. GQA: qkv is [d + 2kv, d];
    SwiGLU: fc is [2ff, d] (gate and up) beside proj [d, ff]. ``tp``/``pp`` replace the recipe's
    (``tp=1, pp=1``: the whole model, ``model.gpt.expected_parameter_count``). MoE: each routed
    layer holds 1/ep of its experts (``ep``: the recipe's ``parallel.ep`` when tp and pp are the
    recipe's too, else 1)."""
    m = cfg.model
    e = (cfg.parallel.ep if tp is None and pp is None else 1) if ep is None else ep
    t = cfg.parallel.tp if tp is None else tp
    pp = cfg.parallel.pp if pp is None else pp
    d, ff, bias = m.d_model, m.ffn_dim, 1 if m.bias else 0
    kv = m.kv_heads * m.head_dim
    attention = (d + 2 * kv) * d // t + d * d // t + bias * ((d + 2 * kv) // t + d)
    fc_rows = ff if m.mlp == "gelu" else 2 * ff
    mlp = fc_rows * d // t + ff * d // t + bias * (fc_rows // t + d)
    norm = d * (1 + (bias if m.norm == "layernorm" else 0))
    norms = (1 if m.block == "parallel" else 2) * norm
    layers = math.ceil(m.n_layer / pp)
    embedding = m.vocab_size * d // t + (m.seq_len * d if m.position == "learned" else 0)
    head = 0 if pp > 1 else norm + (0 if m.tie_embeddings else m.vocab_size * d // t)
    if m.mlp == "moe":  # the stage with the most routed layers; their experts are not split by t
        if t > 1:
            raise ValueError(f"parallel.tp={t}: model.mlp=moe has no tensor-parallel experts yet (use tp 1)")
        stages = [range(start, min(start + layers, m.n_layer)) for start in range(0, m.n_layer, layers)]
        routed = max(sum(m.is_moe_layer(i) for i in stage) for stage in stages)
        experts = routed_expert_parameters(m, layers=1)  # the routed experts of one layer
        moe = moe_layer_parameters(m) - experts + experts // e
        return layers * (attention + mlp + norms) + routed * (moe - mlp) + embedding + head
    return layers * (attention + mlp + norms) + embedding + head


# What one checkpoint holds (``megatrain/checkpoint/state.py``), in bytes per parameter:
#   weights    the training dtype (bf16 2, fp32 4), one copy per (pp, tp) shard, written by DP rank 0;
#              none under ZeRO-3 (its weights live in the fp32 partitions only)
#   optimizer  ZeRO 1-3: fp32 master 4 + two moments 8 (AdamW and LAMB both keep m and v),
#              partitioned over DP, so a checkpoint holds it once; ZeRO 0: every DP rank writes
#              its own whole copy (the moments, and a master only when the weights are bf16)
#   experts    under expert parallelism (parallel.ep = E > 1: ZeRO-0, tp = pp = 1) the routed experts
#              are not replicated: dp_rank e < E writes EP rank e's 1/E slice of them as
#              model-ppPP-tpTT-epEE.safetensors (checkpoint/experts.py), dp_rank 0 the rest, and each
#              rank's optimizer state holds the moments of its own 1/E of the experts only
#   per rank   RNG state and JSON metadata (step, schedule, data position, parameter map): about
#              30 KB for the tiny recipe, counted as RANK_OVERHEAD
# Measured against committed steps of the tiny recipe (fp32 on CPU): 1 rank 10,834,630 bytes vs
# 10,862,592 predicted (+0.3%); 2 ranks ZeRO-1 +0.5%, ZeRO-0 +0.4% (tests/megatrain/reliability/test_preflight.py);
# moe-tiny-cpu at ZeRO-0, 2 ranks EP2: +0.4% in total and per rank (tests/megatrain/parallel/test_plan_checkpoint_moe.py).
RANK_OVERHEAD = 64 * 1024
OPTIMIZER_BYTES = 12  # fp32 master 4 + m 4 + v 4


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint: ``total`` is one committed step (what the durable store holds per
    checkpoint), ``per_node`` the most one node stages on its local disk (its ranks' files),
    ``largest_rank`` the most one rank stages."""

    total: int
    per_node: int
    largest_rank: int


def weight_bytes(cfg: Config, cuda: bool = True) -> int:
    """Bytes per weight in the training dtype; ``auto`` is bf16 on a GPU and fp32 on a CPU."""
    if cfg.train.dtype == "auto":
        return 2 if cuda else 4
    return 2 if cfg.train.dtype == "bf16" else 4


@dataclass(frozen=True)
class _CheckpointTerms:
    """What ``checkpoint_size`` and ``rank_checkpoint_bytes`` count, for one layout."""

    world: int
    dp: int  # replicas: dp x cp ranks hold the same parameters (ZeRO partitions over them)
    weights: int  # bytes per weight written (0 under ZeRO-3)
    optimizer: int  # bytes of optimizer state per parameter a rank updates
    whole: int  # parameters of the whole model (pp > 1 with tied embeddings: the last stage's copy too)
    shard: int  # the most parameters one rank holds
    expert_slice: int  # parameters of one EP rank's slice of the routed experts (0 without EP)


def _checkpoint_terms(cfg: Config, world_size: int | None, cuda: bool) -> _CheckpointTerms:
    p, m = cfg.parallel, cfg.model
    world = world_size or p.world_size or p.tp * p.pp * p.cp * (p.dp or 1)
    weights = 0 if p.zero_stage >= 3 else weight_bytes(cfg, cuda)
    # pp > 1 with tied embeddings: the last stage holds its own copy of the token embedding
    tied_copy = m.vocab_size * m.d_model if p.pp > 1 and m.tie_embeddings else 0
    # any stage's shard is at most the first stage's plus the last stage's head (or tied copy);
    # with EP (tp = pp = 1) it holds the replicated weights and its 1/ep of the routed experts
    shard = params_per_gpu(cfg) + (m.vocab_size * m.d_model // p.tp if p.pp > 1 else 0)
    return _CheckpointTerms(
        world=world, dp=p.data_parallel_size(world) * p.cp, weights=weights,
        optimizer=OPTIMIZER_BYTES if p.zero_stage >= 1 or weights == 2 else 8,
        whole=params_per_gpu(cfg, tp=1, pp=1) + tied_copy, shard=shard,
        expert_slice=routed_expert_parameters(m) // p.ep if p.ep > 1 else 0)


def rank_checkpoint_bytes(cfg: Config, rank: int, world_size: int | None = None, cuda: bool = True) -> int:
    """The bytes ``rank`` stages for one checkpoint (an upper bound at pp > 1: the shard bound):
    its optimizer state (ZeRO >= 1: its 1/(dp cp) of it), the model file of its (pp, tp) shard when
    it is replica 0, and under EP its slice of the routed experts when it is replica e < ep."""
    return _rank_bytes(cfg, _checkpoint_terms(cfg, world_size, cuda), rank)


def _rank_bytes(cfg: Config, c: _CheckpointTerms, rank: int) -> int:
    p = cfg.parallel
    replica = (rank // p.tp) % c.dp  # rank order: tp innermost, then cp, then dp (megatrain/parallel/dims.py)
    written = (c.shard - c.expert_slice if replica == 0 else 0) + (c.expert_slice if replica < p.ep else 0)
    state = math.ceil(c.shard * c.optimizer / c.dp) if p.zero_stage >= 1 else c.shard * c.optimizer
    return written * c.weights + state + RANK_OVERHEAD


def checkpoint_size(cfg: Config, world_size: int | None = None, ranks_per_node: int | None = None,
                    cuda: bool = True) -> CheckpointSize:
    """The size of one checkpoint of ``cfg`` on ``world_size`` ranks, ``ranks_per_node`` to a node
    (default ``parallel.gpus_per_node``); ``cuda``: what ``train.dtype: auto`` resolves to."""
    p, c = cfg.parallel, _checkpoint_terms(cfg, world_size, cuda)
    if p.zero_stage >= 1:  # partitioned over DP: one copy in all
        state = c.whole
    else:  # each DP rank its own; under EP that leaves out the routed experts of the other EP ranks
        state = c.dp * (c.whole - c.expert_slice * (p.ep - 1))
    total = c.whole * c.weights + state * c.optimizer + c.world * RANK_OVERHEAD
    per_node_ranks = min(c.world, ranks_per_node or p.gpus_per_node)
    nodes = [range(start, min(c.world, start + per_node_ranks)) for start in range(0, c.world, per_node_ranks)]
    per_node = max(sum(_rank_bytes(cfg, c, rank) for rank in node) for node in nodes)
    # a node never holds more than the whole checkpoint (the shard bound overcounts at pp > 1);
    # rank 0 is a DP rank 0 (it writes weights) with the largest shard bound: the largest rank
    return CheckpointSize(total=total, per_node=min(per_node, total),
                          largest_rank=min(_rank_bytes(cfg, c, 0), total))


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
    checkpoint: CheckpointSize | None = None  # what one checkpoint of the whole run writes
    total_params: int = 0  # the whole model
    active_params: int = 0  # what one token passes through (MoE: top_k of the routed experts)
    ep: int = 1  # expert parallelism: each GPU holds 1/ep of the routed experts
    cp: int = 1  # context parallelism: each GPU holds seq_len/cp tokens of every sample
    seq_len: int = 0
    policy: str = "none"  # model.activation_checkpointing
    # by policy: the activations as megatrain's kernels store them, term by term (plan_activations.py)
    activations: dict[str, ActivationPlan] = field(default_factory=dict)

    @property
    def states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return self.states_bytes + self.activation_bytes[self.recompute] + self.recompute_working_bytes

    def peak_bytes(self, policy: str | None = None) -> float:
        """Model states + stored activations + working set under ``policy`` (default the recipe's),
        as megatrain's kernels store them."""
        return self.states_bytes + self.activations[policy or self.policy].total_bytes


def memory_plan(cfg: Config, world_size: int | None = None) -> MemoryPlan:
    """The plan for ``world_size`` GPUs (default: parallel.world_size, else tp*pp*dp with the
    recipe's dp, else one data-parallel replica)."""
    p = cfg.parallel
    if world_size is None:
        world_size = p.world_size or p.tp * p.pp * (p.dp or 1)
    dp = p.data_parallel_size(world_size)
    replicas = dp * p.cp  # ZeRO partitions over the dp x cp replicas (context_parallel.py)
    accumulation = cfg.train.grad_accumulation_steps(dp)
    bf16 = cfg.train.dtype in ("bf16", "auto")  # auto is bf16 on the GPUs this plan is for
    n = params_per_gpu(cfg)
    param_b, grad_b, optim_b = (2, 2, 12) if bf16 else (4, 4, 8)
    layers = math.ceil(cfg.model.n_layer / p.pp)
    in_flight = min(p.pp, accumulation)
    policy = cfg.model.activation_checkpointing.policy
    recompute = policy if policy in ("none", "selective") else "full"  # the Korthikanti modes
    stored = {mode: layers * in_flight * activation_bytes_per_layer(cfg, mode) for mode in ("none", "selective", "full")}
    working = activation_bytes_per_layer(cfg, "none") - activation_bytes_per_layer(cfg, recompute)
    return MemoryPlan(
        name=cfg.name, world_size=world_size, dp=dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage,
        dtype="bf16" if bf16 else "fp32", layers_per_stage=layers, micro_batches_in_flight=in_flight, params=n,
        params_bytes=param_b * n / (replicas if p.zero_stage >= 3 else 1),
        grads_bytes=grad_b * n / (replicas if p.zero_stage >= 2 else 1),
        optimizer_bytes=optim_b * n / (replicas if p.zero_stage >= 1 else 1),
        recompute=recompute, activation_bytes=stored, recompute_working_bytes=working,
        checkpoint=checkpoint_size(cfg, world_size, cuda=bf16),
        total_params=expected_parameter_count(cfg.model), active_params=active_parameter_count(cfg.model), ep=p.ep,
        cp=p.cp, seq_len=cfg.seq_len, policy=policy, activations=plans_by_policy(cfg, layers, in_flight),
    )


def format_plan(plan: MemoryPlan) -> str:
    def gib(x: float) -> str:
        return f"{x / GIB:10.2f}"

    optimizer_what = "fp32 master + m + v" if plan.dtype == "bf16" else "m + v"
    lines = [
        f"memory plan: {plan.name} (per GPU, first pipeline stage: embedding + {plan.layers_per_stage} layers)",
        f"layout: tp={plan.tp} pp={plan.pp} dp={plan.dp}{f' ep={plan.ep}' if plan.ep > 1 else ''} "
        f"(world {plan.world_size}), ZeRO-{plan.zero_stage}, "
        f"{plan.dtype}, {plan.micro_batches_in_flight} micro-batches in flight (1F1B)",
        f"parameters on this GPU: {plan.params:,} ({plan.params / 1e9:.2f} B)",
    ]
    if plan.active_params and plan.active_params < plan.total_params:  # MoE: all experts held, top-k computed
        held = "every expert's" if plan.ep == 1 else f"1/{plan.ep} of the experts' (ep={plan.ep})"
        lines.append(f"model: {plan.total_params / 1e9:.2f} B parameters in total, {plan.active_params / 1e9:.2f} B "
                     f"active per token; {held} weights, gradients and optimizer state are held per GPU")
    if plan.checkpoint is not None:  # what the durable store (two of these) and a node's staging disk must hold
        ckpt = plan.checkpoint
        lines.append(f"checkpoint: {ckpt.total / GIB:.2f} GiB (two: {2 * ckpt.total / GIB:.2f} GiB); staged per node "
                     f"{ckpt.per_node / GIB:.2f} GiB, largest rank {ckpt.largest_rank / GIB:.2f} GiB")
    lines += [
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
    if plan.activations:
        lines += ["", *format_activations(plan)]
    return "\n".join(lines)


def format_activations(plan: MemoryPlan) -> list[str]:
    """The per-term block: the recipe's policy term by term, then each policy's per-GPU peak."""
    def gib(x: float) -> str:
        return f"{x / GIB:10.2f}"

    mine = plan.activations[plan.policy]
    tokens = plan.seq_len // plan.cp
    lines = [f"activations as megatrain stores them (policy {plan.policy}, {tokens:,} tokens per sample on this "
             f"GPU: seq_len {plan.seq_len:,} / cp {plan.cp}; megatrain/parallel/plan_activations.py):"]
    lines += [f"  {name:<72}{gib(value)}" for name, value in mine.stored.items() if value]
    lines.append(f"  {'stored':<72}{gib(mine.stored_bytes)}")
    lines += [f"  working set: {name:<59}{gib(value)}" for name, value in mine.working.items() if value]
    lines += ["", f"per-GPU peak by policy (model states {plan.states_bytes / GIB:.2f} GiB + stored + working set):"]
    for policy, act in plan.activations.items():
        mark = "  <- this recipe" if policy == plan.policy else ""
        lines.append(f"  {policy:<12} stored {act.stored_bytes / GIB:8.2f}  working {act.working_bytes / GIB:8.2f}  "
                     f"total {plan.peak_bytes(policy) / GIB:8.2f} GiB{mark}")
    return lines


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
