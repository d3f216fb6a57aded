"""The activation memory of one GPU, term by term, as megatrain's own kernels store it: what
``megatrain plan`` prints under "activations as megatrain stores them", by checkpointing policy
(``model.activation_checkpointing``: none | full | selective | every_n) and by context parallelism.

Per GPU and micro-batch the blocks see N = micro_batch * seq_len / cp tokens (each cp rank holds
seq_len/cp tokens of every sample). Widths per GPU: q = H hd / t, kv = G hd / t, f = ff / t,
heads = H / t; the residual stream is [N/t, d] under sequence parallelism (t > 1), else [N, d];
a column-parallel linear keeps its (all-gathered) [N, d] input. e = bytes per activation (bf16 2).

Stored by one serial block with no recompute (policy none), the GPU kernels (``auto`` on CUDA):
  residual stream    its output and the sum after attention (the two norms' inputs)      2 e d_res
  norm statistics    two rstd rows, fp32                                                  2 * 4
  linear inputs      the qkv and the gate/up projections' inputs (gathered under SP)      2 e d
  q, k, v            written by the fused split + RoPE, saved by the attention kernel     e (q + 2 kv)
  attention output   the out-projection's input (a view of the kernel's output)           e q
  logsumexp          the flash kernel's softmax statistics, fp32                          4 heads
  SwiGLU             [gate | up] (the fused SwiGLU's input) and the down projection's     3 e f
cp > 1 (ring attention, ``ring_attention.py``) adds its fp32 output (4 q, saved for the explicit
backward; the out-projection's input is then a transposed bf16 copy, still e q) and the RoPE
tables gathered at the rank's global positions (cos, sin: [N/b, hd/2] fp32 each, per layer).
The reference kernels (CPU) store more: each norm's normalised rows, q and k rotated beside the
qkv output (v is a view of it), a head-major copy of the attention output, silu(gate).

Policies:
  none       every block keeps the terms above
  selective  the attention core is recomputed (``parallelize._recompute_attention``): q, k, v, the
             logsumexp and (cp > 1) the ring's fp32 output and gathered tables are dropped; the
             core's input (the qkv projection's output, e (q + 2 kv)) is kept by the checkpoint,
             and its output by the out projection. With a flash kernel that is nearly nothing saved
             (4 heads bytes a token); with the ring it saves the fp32 output, 4 q.
  full       each block keeps its input only (e d_res; torch's non-reentrant checkpoint), and one
             block's terms are rebuilt at a time in the backward (the working set)
  every_n    blocks 0, n, 2n, ... as full, the others as none

Outside the blocks: the embedding's output (block 0's input), the final norm's rstd and the loss
as megatrain computes it (``kernels/cross_entropy.py``; ``tensor_parallel._patch_head`` at t > 1):
  t = 1, fused/chunked  the loss's gradients are made in the forward: dh [N, d] (e) and dW [V, d]
                        (e in one chunk, fp32 when the N x V logits exceed ONE_CHUNK_LOGITS);
                        transient: one chunk's logits, e C V (the fused kernel overwrites them)
  t = 1, reference      the fp32 log-softmax [N, V] and the head's input; transient: logits e N V
  t > 1                 vocabulary-parallel: the fp32 softmax [N, V/t], the gathered head input, the
                        targets; transient: the logits (e) and two fp32 copies, [N, V/t] each
At 128k tokens the logits are the largest single tensor (N V: 16384 x 128256 per cp=8 rank).

Transient (the working set, on top of what is stored): one recomputed block (full, every_n), the
loss's logits at the end of the forward, a layer's backward gradients (about [N, 2f] + [N, d]), and
at cp > 1 the ring's plain-torch fp32 per-block math: four [b, heads, c, c] score-sized tensors at
once in the backward (s, p, dO V^T, dS; c = seq_len / (2 cp), the chunk), fp32 copies of q, dO, dq
and of K/V repeated to H heads with their gradients (7 x 4 N q), and the K/V block in flight with
the dK/dV buffers travelling back (e 2 kv + 2 x 4 2 kv per token).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import Config
from megatrain.kernels.cross_entropy import default_chunk_rows

POLICIES = ("none", "selective", "full", "every_n")


@dataclass(frozen=True)
class Shape:
    """One GPU's widths and token count for one micro-batch (see the module docstring)."""

    tokens: float  # N = b s / cp
    batch: int  # b
    e: int  # bytes per activation
    d: int
    d_res: float  # residual width per token: d / t under sequence parallelism, else d
    q: float  # H hd / t
    kv: float  # G hd / t
    f: float  # ff / t
    heads: float  # H / t
    head_dim: int
    vocab: int
    t: int
    cp: int
    mlp: str
    reference: bool  # the plain-torch kernels (CPU) instead of the fused ones


def activation_element_bytes(cfg: Config) -> int:
    """bf16 (and auto, bf16 on the GPUs a plan is for) 2, fp32 4."""
    return 4 if cfg.train.dtype == "fp32" else 2


def shape_of(cfg: Config, reference: bool = False) -> Shape:
    m, p = cfg.model, cfg.parallel
    t, cp = p.tp, p.cp
    sp = p.sequence_parallel and t > 1
    return Shape(tokens=cfg.train.micro_batch_size * cfg.seq_len / cp, batch=cfg.train.micro_batch_size,
                 e=activation_element_bytes(cfg), d=m.d_model, d_res=m.d_model / t if sp else m.d_model,
                 q=m.n_head * m.head_dim / t, kv=m.kv_heads * m.head_dim / t, f=m.ffn_dim / t, heads=m.n_head / t,
                 head_dim=m.head_dim, vocab=m.vocab_size, t=t, cp=cp, mlp=m.mlp, reference=reference)


def _attention_terms(s: Shape, selective: bool) -> dict[str, float]:
    """Bytes per token of one block's attention part (the core's terms dropped under selective)."""
    e, ring = s.e, s.cp > 1
    terms: dict[str, float] = {}
    core = {}
    if s.reference:  # v is a view of the qkv output, which therefore stays; q and k rotated beside it
        terms["qkv projection output (v is a view of it)"] = e * (s.q + 2 * s.kv)
        core["q, k rotated (reference RoPE)"] = e * (s.q + s.kv)
    else:
        core["q, k, v (saved by the attention kernel)"] = e * (s.q + 2 * s.kv)
    if ring:
        core["ring attention output, fp32"] = 4 * s.q
        core["RoPE tables gathered at the rank's positions, fp32"] = 4 * s.head_dim / s.batch  # [N/b, hd] a layer
    elif s.reference:
        core["attention kernel output (head-major)"] = e * s.q
    core["attention logsumexp, fp32"] = 4 * s.heads
    terms["attention output (out-projection input)"] = e * s.q
    if selective:
        if not s.reference:  # the checkpointed core keeps its input, the qkv projection's output
            terms["attention core input (qkv, kept by the checkpoint)"] = e * (s.q + 2 * s.kv)
        return terms
    return {**terms, **core}


def norm_keeps_input(s: Shape) -> bool:
    """The fused RMSNorm (and the reference in fp32) saves its input; the reference with 16-bit
    inputs saves its fp32 copy instead (counted with the normalised rows)."""
    return not (s.reference and s.e < 4)


def block_terms(s: Shape, policy: str) -> dict[str, float]:
    """Bytes per token that one block keeps for its backward under ``policy`` (none, selective or
    full: every_n is blocks of full and none), its output aside (``residual_outputs``)."""
    e = s.e
    if policy == "full":  # the checkpoint keeps the block's input: the previous block's output
        return {}
    terms = {
        "mid-block residual sum (the second norm's input)": e * s.d_res if norm_keeps_input(s) else 0.0,
        "norm rstd, fp32": 2 * 4 * s.d_res / s.d,
        "qkv and gate/up inputs (gathered under SP)": 2 * e * s.d,
    }
    if s.reference:  # each norm keeps its normalised rows (and, for 16-bit inputs, the fp32 copy)
        terms["norms' normalised rows (reference)"] = 2 * (e * s.d + (4 * s.d if e < 4 else 0))
    terms.update(_attention_terms(s, policy == "selective"))
    if s.mlp == "gelu":
        terms["MLP: GeLU input and output"] = 2 * e * s.f
    else:
        terms["SwiGLU: [gate | up] and the down projection's input"] = 3 * e * s.f
        if s.reference:
            terms["silu(gate) (reference SwiGLU)"] = e * s.f
    return terms


def residual_outputs(cfg: Config, s: Shape, layers: int) -> tuple[int, bool]:
    """(how many of the blocks' outputs stay alive, whether the embedding's does): an output is
    kept by the next block's checkpoint (a recomputed block keeps its input) or by the norm that
    reads it when that norm keeps its input (the next block's first, or the final norm)."""
    policy = cfg.model.activation_checkpointing
    keeps = norm_keeps_input(s)
    kept = sum(keeps or (i + 1 < layers and policy.recomputed(i + 1)) for i in range(layers))
    return kept, keeps or policy.recomputed(0)


def recomputed_blocks(cfg: Config, layers: int) -> int:
    """How many of ``layers`` blocks are recomputed whole (full: all; every_n: 0, n, 2n, ...)."""
    policy = cfg.model.activation_checkpointing
    return sum(policy.recomputed(i) for i in range(layers))


def loss_impl(cfg: Config, reference: bool) -> str:
    """What the loss runs as: vocab-parallel at t > 1, else model.kernels.cross_entropy (auto:
    fused on a GPU, reference on a CPU)."""
    if cfg.parallel.tp > 1:
        return "vocab-parallel"
    impl = cfg.model.kernels.cross_entropy
    return ("reference" if reference else "fused") if impl == "auto" else impl


def head_terms(s: Shape, impl: str) -> tuple[dict[str, float], dict[str, float]]:
    """(stored, transient) bytes of one micro-batch outside the blocks: the embedding output, the
    final norm, the loss (see the module docstring)."""
    n, e, v = s.tokens, s.e, s.vocab
    stored = {"final norm rstd, fp32": 4 * n * s.d_res / s.d}
    if s.reference:
        stored["final norm's normalised rows (reference)"] = n * (e * s.d + (4 * s.d if e < 4 else 0))
    if impl == "vocab-parallel":
        stored["loss: vocab-parallel softmax [N, V/t], fp32"] = 4 * n * v / s.t
        stored["loss: head input (gathered) and targets"] = e * n * s.d + 9 * n
        return stored, {"loss: logits [N, V/t] and two fp32 copies": (e + 8) * n * v / s.t}
    if impl == "reference":
        stored["loss: log-softmax [N, V], fp32"] = 4 * n * v
        stored["loss: head input"] = e * n * s.d
        return stored, {"loss: logits [N, V]": (e + (4 if e < 4 else 0)) * n * v}
    rows = default_chunk_rows(int(n), v)
    one_chunk = rows >= n
    stored["loss: dh [N, d] made in the forward"] = e * n * s.d
    stored[f"loss: dW [V, d] ({'one chunk' if one_chunk else 'fp32 sum of chunks'})"] = (e if one_chunk else 4) * v * s.d
    chunk = e * rows * v if impl == "fused" else rows * v * (2 * e + (4 if e < 4 else 0))
    return stored, {f"loss: one chunk of logits [{rows}, V]": chunk}


def ring_working(s: Shape) -> dict[str, float]:
    """Transient bytes of one layer's ring attention backward at cp > 1 (empty at cp = 1)."""
    if s.cp == 1:
        return {}
    c = s.tokens / s.batch / 2  # tokens per chunk: each rank holds two
    return {
        "ring: fp32 scores of a chunk pair, 4 x [b, H/t, c, c]": 4 * 4 * s.batch * s.heads * c * c,
        "ring: fp32 q, dO, dq, repeated K/V and their gradients": 7 * 4 * s.tokens * s.q,
        "ring: K/V block in flight, dK/dV buffers travelling": s.tokens * (s.e * 2 * s.kv + 2 * 4 * 2 * s.kv),
    }


@dataclass
class ActivationPlan:
    """One GPU's activation memory under one policy: stored terms (summed over its layers and the
    micro-batches in flight) and the transient working set on top of them."""

    policy: str
    stored: dict[str, float]
    working: dict[str, float]

    @property
    def stored_bytes(self) -> float:
        return sum(self.stored.values())

    @property
    def working_bytes(self) -> float:
        return sum(self.working.values())

    @property
    def total_bytes(self) -> float:
        return self.stored_bytes + self.working_bytes


def _sum_into(total: dict[str, float], terms: dict[str, float], factor: float) -> None:
    for name, value in terms.items():
        total[name] = total.get(name, 0.0) + value * factor


def activation_plan(cfg: Config, layers: int | None = None, in_flight: int = 1,
                    reference: bool = False) -> ActivationPlan:
    """The recipe's policy on one GPU holding ``layers`` blocks (default all) with ``in_flight``
    micro-batches alive (1F1B's first stage: pp); ``reference``: the CPU kernels."""
    s = shape_of(cfg, reference)
    layers = cfg.model.n_layer if layers is None else layers
    policy = cfg.model.activation_checkpointing.policy
    recomputed = recomputed_blocks(cfg, layers)
    plain = layers - recomputed
    outputs, embedding = residual_outputs(cfg, s, layers)
    stored: dict[str, float] = {
        "embedding output (block 0's input)": s.e * s.tokens * s.d_res * in_flight * embedding,
        "block outputs (the next block's or final norm's input)": s.e * s.tokens * s.d_res * in_flight * outputs,
    }
    _sum_into(stored, block_terms(s, "selective" if policy == "selective" else "none"), plain * s.tokens * in_flight)
    head, loss_transient = head_terms(s, loss_impl(cfg, reference))
    _sum_into(stored, head, 1.0)  # the last stage runs one micro-batch's loss at a time
    block_none = sum(block_terms(s, "none").values()) * s.tokens
    layer_transient = {"backward: one layer's gradients (about [N, 2f] + [N, d])": s.e * s.tokens * (2 * s.f + s.d)}
    if recomputed:
        layer_transient["recompute: one block's terms rebuilt"] = block_none
    elif policy == "selective":
        kept = sum(block_terms(s, "selective").values()) * s.tokens
        layer_transient["recompute: one attention core rebuilt"] = max(0.0, block_none - kept)
    layer_transient.update(ring_working(s))
    # the loss's logits exist at the end of the forward, a layer's working set in the backward
    working = loss_transient if sum(loss_transient.values()) > sum(layer_transient.values()) else layer_transient
    return ActivationPlan(policy=policy, stored=stored, working=dict(working))


def with_policy(cfg: Config, policy: str, n: int = 2) -> Config:
    """``cfg`` with ``model.activation_checkpointing`` set to ``policy`` (every_n: one block in ``n``)."""
    from megatrain.config.model import CheckpointingPolicy

    spec = CheckpointingPolicy(policy=policy, n=n if policy == "every_n" else 1)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"activation_checkpointing": spec})})


def plans_by_policy(cfg: Config, layers: int | None = None, in_flight: int = 1, reference: bool = False,
                    ) -> dict[str, ActivationPlan]:
    n = cfg.model.activation_checkpointing.n if cfg.model.activation_checkpointing.policy == "every_n" else 2
    return {p: activation_plan(with_policy(cfg, p, n), layers, in_flight, reference) for p in POLICIES}
