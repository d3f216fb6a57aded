"""One LAMB step over a list of tensors in three Triton launches (the lead's ``optim/lamb.py``
calls it on CUDA). The math, per tensor w with gradient g, at step t:

    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
    trust = min(||w|| / ||u||, max_trust_ratio)  if both norms > 0  else 1
    w = w - lr trust u

Why Triton and not torch._foreach: the foreach form makes about a dozen passes over the
parameters (each op reads and writes whole lists, u is materialised) plus one norm launch per
tensor. Here:
  1. moments kernel: reads g, m, v, w; writes m, v; sums w^2 and u^2 per chunk (24 B/elem fp32)
  2. norms kernel:   one program per tensor sums its chunks' partials in a fixed order
                     (deterministic: no atomics) and writes the clipped trust ratio
  3. apply kernel:   re-reads m, v, w, recomputes u the same way, writes w      (16 B/elem)
40 bytes per fp32 parameter in all: about 12 ms for 1.3B parameters at 4.2 TB/s. Measured on an
H200 for the 1.3B GPT's 244 tensors: 13.4 ms (93% of the copy rate), against 54 ms for the
torch._foreach version.

"Multi-tensor": every launch covers all tensors. Work is cut into chunks of 64K elements; a
chunk table says which tensor and which offset each program handles. Tensors are addressed as
(first tensor's pointer + element offset), so Triton keeps the pointer type of the list;
when every tensor is 64-byte aligned (all fresh allocations are), the offsets carry an alignment
hint so loads stay 16 bytes wide. Lists whose dtypes differ are split into groups by dtype.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

CHUNK = 65536  # elements per program
_BLOCK = 1024  # elements per inner step (8 warps x 32 threads x 4)


@triton.jit
def _tensor_ptrs(chunk, CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMEL, T, P, G, M, V,
                 ALIGNED: tl.constexpr, CHUNK: tl.constexpr):
    """The four pointers (w, g, m, v at this chunk's start), the tensor id and the chunk length."""
    t = tl.load(CHUNK_TENSOR + chunk)
    start = tl.load(CHUNK_START + chunk)
    numel = tl.load(NUMEL + t)
    off_p = tl.load(OFFSETS + t)
    off_g = tl.load(OFFSETS + T + t)
    off_m = tl.load(OFFSETS + 2 * T + t)
    off_v = tl.load(OFFSETS + 3 * T + t)
    if ALIGNED:
        off_p = tl.multiple_of(off_p, 16)
        off_g = tl.multiple_of(off_g, 16)
        off_m = tl.multiple_of(off_m, 16)
        off_v = tl.multiple_of(off_v, 16)
    start = tl.multiple_of(start, CHUNK)
    return (P + off_p + start, G + off_g + start, M + off_m + start, V + off_v + start, t,
            tl.minimum(numel - start, CHUNK).to(tl.int32))


@triton.jit
def _update(w, g, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, bc1, bc2, eps, weight_decay):
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    u = (m / bc1) / (tl.sqrt(v / bc2) + eps) + weight_decay * w
    return m, v, u


@triton.jit
def _lamb_moments_kernel(
    CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMEL, PARTIAL, T, P, G, M, V,
    beta1, one_minus_beta1, beta2, one_minus_beta2, bc1, bc2, eps, weight_decay,
    ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    p, g, m, v, t, n = _tensor_ptrs(chunk, CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMEL, T, P, G, M, V, ALIGNED, CHUNK)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n
        w_ = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32)
        g_ = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        m_ = tl.load(m + offs, mask=mask, other=0.0).to(tl.float32)
        v_ = tl.load(v + offs, mask=mask, other=0.0).to(tl.float32)
        m_, v_, u = _update(w_, g_, m_, v_, beta1, one_minus_beta1, beta2, one_minus_beta2, bc1, bc2,
                             eps, weight_decay)
        tl.store(m + offs, m_.to(M.dtype.element_ty), mask=mask)
        tl.store(v + offs, v_.to(V.dtype.element_ty), mask=mask)
        acc_w += w_ * w_
        acc_u += tl.where(mask, u * u, 0.0)
    tl.store(PARTIAL + 2 * chunk, tl.sum(acc_w, axis=0))
    tl.store(PARTIAL + 2 * chunk + 1, tl.sum(acc_u, axis=0))


@triton.jit
def _lamb_trust_kernel(PARTIAL, CHUNK_BEGIN, TRUST, SUMS, max_trust_ratio, WRITE_SUMS: tl.constexpr,
                       BLOCK: tl.constexpr):
    t = tl.program_id(0)
    begin = tl.load(CHUNK_BEGIN + t)
    end = tl.load(CHUNK_BEGIN + t + 1)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(begin, end, BLOCK):
        idx = c + tl.arange(0, BLOCK)
        mask = idx < end
        acc_w += tl.load(PARTIAL + 2 * idx, mask=mask, other=0.0)
        acc_u += tl.load(PARTIAL + 2 * idx + 1, mask=mask, other=0.0)
    if WRITE_SUMS:  # squared norms for the caller to combine (ZeRO spans of one model tensor)
        tl.store(SUMS + 2 * t, tl.sum(acc_w, axis=0))
        tl.store(SUMS + 2 * t + 1, tl.sum(acc_u, axis=0))
    else:
        w_norm = tl.sqrt(tl.sum(acc_w, axis=0))
        u_norm = tl.sqrt(tl.sum(acc_u, axis=0))
        ratio = tl.minimum(w_norm / u_norm, max_trust_ratio)
        tl.store(TRUST + t, tl.where((w_norm > 0.0) & (u_norm > 0.0), ratio, 1.0))


@triton.jit
def _lamb_apply_kernel(
    CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMEL, TRUST, T, P, G, M, V,
    lr, bc1, bc2, eps, weight_decay,
    ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    p, g, m, v, t, n = _tensor_ptrs(chunk, CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMEL, T, P, G, M, V, ALIGNED, CHUNK)
    step_size = lr * tl.load(TRUST + t)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n
        w_ = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32)
        m_ = tl.load(m + offs, mask=mask, other=0.0).to(tl.float32)
        v_ = tl.load(v + offs, mask=mask, other=0.0).to(tl.float32)
        # m, v are already updated: recompute only u (same expression as the moments kernel).
        u = (m_ / bc1) / (tl.sqrt(v_ / bc2) + eps) + weight_decay * w_
        tl.store(p + offs, (w_ - step_size * u).to(P.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=16)
def chunk_layout(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a list of tensor sizes: chunk -> tensor id, chunk -> start element, tensor -> first
    chunk (with a final end marker), tensor -> numel. Cached: the sizes never change in a run."""
    numel = torch.tensor(numels, dtype=torch.int64)
    counts = (numel + CHUNK - 1) // CHUNK
    begin = torch.zeros(len(numels) + 1, dtype=torch.int64)
    begin[1:] = torch.cumsum(counts, 0)
    chunk_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    chunk_start = (torch.arange(int(begin[-1])) - begin[:-1].repeat_interleave(counts)) * CHUNK
    return (chunk_tensor.to(device), chunk_start.to(device), begin.to(torch.int32).to(device), numel.to(device))


def element_offsets(tensors: list[torch.Tensor]) -> list[int]:
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    return [(t.data_ptr() - base) // size for t in tensors]


def _check_group(params, grads, exp_avgs, exp_avg_sqs) -> None:
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != len(params):
            raise ValueError(f"lamb_step_fused: {len(params)} params but {len(lst)} {name}")
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(f"lamb_step_fused: shapes differ: {p.shape}, {g.shape}, {m.shape}, {v.shape}")
        if not all(x.is_contiguous() for x in (p, g, m, v)):
            raise ValueError("lamb_step_fused: tensors must be contiguous")


def _lamb_group(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, bc1, bc2, eps, weight_decay,
                max_trust_ratio, trust_from_sums=None) -> None:
    device = params[0].device
    chunk_tensor, chunk_start, chunk_begin, numel = chunk_layout(tuple(p.numel() for p in params), device)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    offsets = torch.tensor([o for lst in lists for o in element_offsets(lst)], dtype=torch.int64).to(device)
    aligned = all(x.data_ptr() % 64 == 0 for lst in lists for x in lst)
    n_chunks, n_tensors = chunk_tensor.numel(), len(params)
    partial = torch.empty(2 * n_chunks, dtype=torch.float32, device=device)
    trust = torch.empty(n_tensors, dtype=torch.float32, device=device)
    P, G, M, V = params[0], grads[0], exp_avgs[0], exp_avg_sqs[0]
    _lamb_moments_kernel[(n_chunks,)](
        chunk_tensor, chunk_start, offsets, numel, partial, n_tensors, P, G, M, V,
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, bc1, bc2, eps, weight_decay,
        ALIGNED=aligned, CHUNK=CHUNK, BLOCK=_BLOCK, num_warps=8,
    )
    if trust_from_sums is None:
        _lamb_trust_kernel[(n_tensors,)](partial, chunk_begin, trust, partial, max_trust_ratio,
                                         WRITE_SUMS=False, BLOCK=256, num_warps=4)
    else:
        sums = torch.empty(n_tensors, 2, dtype=torch.float32, device=device)
        _lamb_trust_kernel[(n_tensors,)](partial, chunk_begin, trust, sums, max_trust_ratio,
                                         WRITE_SUMS=True, BLOCK=256, num_warps=4)
        trust = trust_from_sums(sums).to(torch.float32).contiguous()
    _lamb_apply_kernel[(n_chunks,)](
        chunk_tensor, chunk_start, offsets, numel, trust, n_tensors, P, G, M, V,
        lr, bc1, bc2, eps, weight_decay, ALIGNED=aligned, CHUNK=CHUNK, BLOCK=_BLOCK, num_warps=8,
    )


@torch.no_grad()
def lamb_step_fused(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, max_trust_ratio: float,
                    trust_from_sums: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Update params, exp_avgs and exp_avg_sqs in place (one LAMB step; ``step`` counts from 1).
    Tensors must be contiguous; dtypes may mix (fp32 master weights, bf16 grads): each
    (device, dtypes) group gets its own three launches, computing in fp32.

    ``trust_from_sums`` replaces the per-tensor trust ratio: it gets the squared norms
    [len(params), 2] (||w||^2, ||u||^2 of each tensor) and returns the ratio to apply to each.
    ZeRO uses it when the tensors are spans of a flat partition and a model tensor's norm
    is summed over its spans and ranks (``optim/lamb.py``). All tensors must then share dtypes."""
    if step < 1:
        raise ValueError(f"lamb_step_fused: step counts from 1, got {step}")
    _check_group(params, grads, exp_avgs, exp_avg_sqs)
    groups: dict[tuple, list[int]] = {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.numel():
            groups.setdefault((p.device, p.dtype, g.dtype, m.dtype, v.dtype), []).append(i)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, bc1=1.0 - beta1**step, bc2=1.0 - beta2**step, eps=eps,
                 weight_decay=weight_decay, max_trust_ratio=max_trust_ratio)
    if trust_from_sums is not None and len(groups) > 1:
        raise ValueError("lamb_step_fused: trust_from_sums needs one device and one set of dtypes for all tensors")
    if trust_from_sums is not None and sum(len(idx) for idx in groups.values()) != len(params):
        raise ValueError("lamb_step_fused: trust_from_sums needs non-empty tensors")
    for idx in groups.values():
        _lamb_group([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                    [exp_avg_sqs[i] for i in idx], **hyper, trust_from_sums=trust_from_sums)
