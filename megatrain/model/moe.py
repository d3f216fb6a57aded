"""Mixture-of-Experts feed-forward (``model.mlp=moe``, knobs in ``model.moe``): a router picks
each token's top-k of E SwiGLU experts; tokens are permuted so each expert's rows are contiguous,
the experts run as grouped GEMMs (``moe_experts.py``), and the outputs are permuted back and
summed with the router's weights. Dropless: no capacity factor, no token is dropped.

    y = sum_{e in topk(s + b)} w_e(x) expert_e(x)  [+ shared(x)]

- scores s = softmax(x W_r^T) or sigmoid(x W_r^T) (fp32); the choice adds the aux-free bias b
  (DeepSeek-V3: steers which experts are chosen, never the weights); w = the chosen scores,
  renormalised to sum to 1 when ``norm_topk_prob``.
- ``dispatch`` (sort the slots by expert, gather the rows) and ``unpermute`` (back to the tokens,
  summed; both moves in ``kernels/moe_permute.py``) are the seam where expert parallelism puts its
  all-to-all (tokens to the ranks holding their experts and back). Expert ids are global.
- Where the weights w_e go: w_e proj_e(a) = proj_e(w_e a), so local experts scale each row's
  SwiGLU output a (width ff) by its weight, inside the experts, and the combine is a plain sum,
  whose backward copies rows and reads no expert output (on moe-gpu-2b it would read 1 GB a
  layer per micro-batch of 32, and keep the experts' outputs alive until then). Under expert
  parallelism the weights stay on the token's rank: the combine weights the returned rows.
- Load balance: ``aux_loss`` adds coef * E * sum_i f_i P_i (f_i: share of the routed slots that
  went to expert i, no gradient; P_i: mean score of i) and the z-loss coef * mean(logsumexp^2).
  Under context parallelism a micro-batch's tokens are spread over the cp ranks: f counts the
  slots of all of them (``token_group``), P stays the rank's mean, and averaging the ranks'
  gradients (as cp does) gives one process's penalty exactly.
  These penalties never reach the trainer's loss value: ``AddAuxGrad`` passes the layer's output
  through unchanged and, in the backward, gives the penalty the gradient it would have as a term
  of the loss (scaled by ``aux_loss_scale``: 1 / gradient-accumulation steps, as DeepSpeed scales
  the loss). This works inside activation checkpointing and pipeline stages alike, and the logged
  loss stays the language-model loss.
- ``aux_free``: after each optimizer step ``end_step`` moves b_i by rate * sign(mean load - load_i),
  from the token counts of the whole step (summed over data-parallel ranks, so b stays equal on
  every replica). b is a persistent buffer: it is checkpointed and resumed.

State-dict names: ``mlp.router.gate.weight`` [E, d], ``mlp.router.bias`` [E] (buffer),
``mlp.experts.fc`` [E, 2 ff, d], ``mlp.experts.proj`` [E, d, ff], and with shared experts
``mlp.shared.fc.weight`` [2 n_s ff, d], ``mlp.shared.proj.weight`` [d, n_s ff].

``end_step(model)`` also returns the step's expert-load health per MoE layer: each expert's token
share and the router's mean entropy (nats; ln E is uniform), for metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from megatrain.config import ModelConfig
from megatrain.kernels.moe_permute import Slots, group_slots, permute, unpermute
from megatrain.kernels.moe_router import expert_counts, topk_experts
from megatrain.model.mlp import SwiGLU
from megatrain.model.moe_experts import Experts

# The router's weights applied inside local experts (see the module docstring); False weights the
# combine instead, as under expert parallelism (benchmarks/mfu.py's A/B row `weighted-combine`).
WEIGHTS_IN_EXPERTS = True

@dataclass
class Routing:
    logits: torch.Tensor  # [N, E] fp32
    probs: torch.Tensor  # [N, E] fp32: the scores as a distribution (softmax, or sigmoids over their sum)
    experts: torch.Tensor  # [N, k] int64 global expert ids, best first
    weights: torch.Tensor  # [N, k] fp32 combine weights


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.gate = nn.Linear(cfg.d_model, m.n_experts, bias=False)  # weight [E, d]
        self.register_buffer("bias", torch.zeros(m.n_experts))  # [E] aux-free bias: selection only
        self.score, self.top_k, self.norm_topk = m.router_score, m.top_k, m.norm_topk_prob
        self.impl = cfg.kernels.moe_router

    def forward(self, x: torch.Tensor) -> Routing:  # x [N, d]
        logits = self.gate(x).float()  # [N, E]
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        experts = topk_experts(scores, self.bias, self.top_k, self.impl)  # [N, k]
        weights = scores.gather(1, experts)  # [N, k]
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(logits, probs, experts, weights)


def dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int, impl: str = "auto",
             counts_impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, Slots]:
    """x [N, d], experts [N, k] -> (rows [N k, d] grouped by expert, counts [E], slots): slot j =
    token j // k's (j % k)-th choice; rows[i] is slot slots.order[i]. No host sync."""
    slots = group_slots(experts, n_experts)
    counts = expert_counts(experts, n_experts, counts_impl)  # [E]
    return permute(x, slots, impl), counts, slots


class AddAuxGrad(torch.autograd.Function):
    """Identity on ``out``; the backward gives ``penalty`` the gradient ``scale`` (d loss / d penalty)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, penalty: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, device=grad.device, dtype=torch.float32), None


class MoE(nn.Module):
    """Router -> dispatch -> experts -> combine (+ shared experts), on [B, T, d]."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        m = cfg.moe
        self.layer, self.n_experts, self.cfg = layer, m.n_experts, m
        self.router = Router(cfg)
        self.permute_impl = cfg.kernels.moe_permute
        self.experts = Experts(m.n_experts, cfg.d_model, cfg.expert_ffn_dim, cfg.kernels.experts, cfg.kernels.swiglu)
        shared = cfg.model_copy(update={"d_ff": m.n_shared_experts * cfg.expert_ffn_dim, "bias": False})
        self.shared = SwiGLU(shared) if m.n_shared_experts else None
        self.aux_loss_scale = 1.0  # set_aux_loss_scale: 1 / gradient-accumulation steps
        # expert parallelism sets a callable (rows, counts, experts) -> outputs that takes the rows to
        # the ranks holding their experts and back (megatrain/parallel/expert_parallel.py); None: local
        self.exchange = None
        # context parallelism sets the cp group: its ranks hold chunks of the same samples, so the
        # balance loss's expert shares f are those of the whole samples (apply_context_parallel_moe)
        self.token_group = None
        # the step's statistics (not checkpointed): routed slots per expert; tokens, entropy, aux, z, calls
        self.register_buffer("load", torch.zeros(m.n_experts), persistent=False)
        self.register_buffer("sums", torch.zeros(5), persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        """The layer's output, plus ``residual`` [B, T, d] when given: the serial block's skip
        connection, which the combine kernel adds while it writes the output (one pass less over
        [tokens, d])."""
        # The profiler ranges (benchmarks/mfu_moe.py splits the step's time by them) cost a few
        # microseconds each in eager mode; torch.compile drops them from compiled code.
        h = x.reshape(-1, x.shape[-1])  # [N, d]
        with record_function("moe.router"):
            routing = self.router(h)
        with record_function("moe.dispatch"):
            rows, counts, slots = dispatch(h, routing.experts, self.n_experts, self.permute_impl,
                                           self.router.impl)  # [N k, d], [E]
        shared, weights = None, routing.weights
        if self.exchange is None and WEIGHTS_IN_EXPERTS:
            # [N k] each expert row's weight; index_select's backward is an index_add (order is a
            # permutation: one add per slot), where indexing's would sort the indices first
            row_weights = routing.weights.reshape(-1).index_select(0, slots.order)
            y, weights = self._run_experts(rows, counts, row_weights), None
        elif self.exchange is None:
            y = self._run_experts(rows, counts)
        else:
            with record_function("moe.exchange"):  # the all-to-all there and back around the experts
                # the shared expert needs no exchange: it runs while the rows travel
                beside = (lambda: self._run_shared(h)) if self.shared is not None else None
                y, shared = self.exchange(rows, counts, self._run_experts, beside)
        # what the combine adds to the routed sum: the residual and the shared expert's output
        skip = residual.reshape(h.shape) if residual is not None else None
        if self.shared is not None:
            shared = shared if shared is not None else self._run_shared(h)
            skip = shared if skip is None else skip + shared
        fused = skip is not None and skip.dtype == y.dtype  # the kernel sums in fp32, writes y's dtype
        with record_function("moe.combine"):
            out = unpermute(y, weights, slots, self.permute_impl, skip if fused else None).to(x.dtype)  # [N, d]
        if skip is not None and not fused:
            out = out + skip
        out = out.view_as(x)
        if self.training:
            with record_function("moe.balance"):
                aux, z = self.balance_loss(routing, counts), self.z_loss(routing)
                penalty = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
                if penalty.requires_grad and torch.is_grad_enabled():
                    out = AddAuxGrad.apply(out, penalty, self.aux_loss_scale)
                self._record(routing, counts, aux, z)
        return out

    def _run_shared(self, h: torch.Tensor) -> torch.Tensor:
        with record_function("moe.shared"):
            return self.shared(h)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        with record_function("moe.experts"):
            return self.experts(rows, counts, scale)

    def balance_loss(self, routing: Routing, counts: torch.Tensor) -> torch.Tensor:
        """E * sum_i f_i P_i (1 when perfectly balanced); 0 unless load_balance is aux_loss."""
        if self.cfg.load_balance != "aux_loss":
            return routing.logits.new_zeros(())
        counts = counts.float()  # a copy of the integer counts: the sum below does not touch the caller's
        if self.token_group is not None:  # chunks of the same samples on other ranks: their slots count too
            dist.all_reduce(counts, group=self.token_group)
        f = counts / counts.sum()  # [E] share of the routed slots, no gradient
        return self.n_experts * (f * routing.probs.mean(0)).sum()

    def z_loss(self, routing: Routing) -> torch.Tensor:
        if self.cfg.z_loss_coef == 0:
            return routing.logits.new_zeros(())
        return torch.logsumexp(routing.logits, -1).square().mean()

    @torch.no_grad()
    def _record(self, routing: Routing, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        """Add this micro-batch to the step's statistics (a recompute under activation
        checkpointing adds it twice: shares and means are unchanged by that)."""
        entropy = -(routing.probs * routing.probs.clamp_min(1e-20).log()).sum(-1)  # [N]
        self.load += counts.float()
        one = entropy.new_ones(())
        self.sums += torch.stack([one * entropy.numel(), entropy.sum(), aux.detach(), z.detach(), one])


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the penalties get per micro-batch (DeepSpeed divides each micro-batch's loss
    by the accumulation steps; the penalties must be divided likewise)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


@torch.no_grad()
def end_step(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict | None:
    """After the optimizer step: sum the step's statistics over ``group`` (data parallel), move
    the aux-free biases, reset, and return the expert-load health (None without MoE layers):
    {"layers": {layer: {"share": [E], "entropy": nats, "max_over_mean": x}}, "aux_loss": mean,
    "z_loss": mean, "max_over_mean": worst layer's}."""
    layers = moe_layers(model)
    if not layers:
        return None
    stats = torch.cat([torch.cat([m.load, m.sums]) for m in layers])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    sizes = [m.n_experts + 5 for m in layers]
    for m, row in zip(layers, stats.split(sizes)):
        if m.cfg.load_balance == "aux_free":  # on the device (no load at all: every sign is 0)
            load = row[:m.n_experts]
            m.router.bias += m.cfg.bias_update_rate * torch.sign(load.mean() - load)
        m.load.zero_()
        m.sums.zero_()
    # one copy to the host for all layers: each copy waits for the GPU's queue to drain
    out: dict = {"layers": {}}
    aux = z = worst = 0.0
    for m, row in zip(layers, stats.cpu().split(sizes)):
        load, (tokens, entropy, aux_sum, z_sum, calls) = row[:m.n_experts], row[m.n_experts:].tolist()
        total = float(load.sum())
        share = (load / total if total else load).tolist()
        balance = max(share) * m.n_experts if total else 0.0
        out["layers"][str(m.layer)] = {"share": [round(s, 5) for s in share], "entropy": entropy / max(tokens, 1),
                                       "max_over_mean": balance}
        aux += aux_sum / max(calls, 1)
        z += z_sum / max(calls, 1)
        worst = max(worst, balance)
    out.update(aux_loss=aux / len(layers), z_loss=z / len(layers), max_over_mean=worst)
    return out
