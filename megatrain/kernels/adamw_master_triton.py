"""``adamw_master.py``'s step in one Triton launch over the whole gradient list.

Work is cut into chunks of ``lamb_triton.CHUNK`` elements that never straddle two gradients (the
chunk table of the multi-tensor LAMB, ``lamb_triton.chunk_layout``). A chunk knows its gradient's
offset along the flat master vectors and, as the LAMB kernel addresses its lists, the gradient's
element offset from the first gradient's pointer. Per element it reads the gradient (2 bytes in
bf16), the master and both moments (12), and writes those three and the 16-bit weight (14).

The bias corrections are computed per program from the device step count; the clip
factor is read from the device too: no host sync.

This module imports Triton at the top: ``megatrain.kernels.adamw_master`` imports it lazily.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from megatrain.kernels.lamb_triton import CHUNK, chunk_layout, element_offsets

_BLOCK = 1024  # elements per inner step (8 warps x 32 threads x 4)


@triton.jit
def _adamw_master_kernel(
    CHUNK_TENSOR, CHUNK_START, POS, GOFF, NUMEL, P, M, V, OUT, G, STEP, CLIP,
    lr, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    HAS_CLIP: tl.constexpr, ALIGNED: tl.constexpr, N_ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    chunk = tl.program_id(0)
    t = tl.load(CHUNK_TENSOR + chunk)
    start = tl.load(CHUNK_START + chunk)
    n = tl.minimum(tl.load(NUMEL + t) - start, CHUNK).to(tl.int32)
    if N_ALIGNED:  # the mask idx < n then holds in runs of 16: loads and stores stay vectorised
        n = tl.multiple_of(n, 16)
    pos = tl.load(POS + t) + start  # along the flat master, moments and 16-bit weights
    goff = tl.load(GOFF + t) + start  # from the first gradient's pointer
    if ALIGNED:
        pos = tl.multiple_of(pos, 16)
        goff = tl.multiple_of(goff, 16)
    step = tl.load(STEP).to(tl.float32)
    bias1 = 1.0 - tl.exp(step * log_beta1)  # 1 - beta1^t in fp32, as torch's fused AdamW
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
    step_size = lr / bias1
    decay = 1.0 - lr * weight_decay
    if HAS_CLIP:
        clip = tl.load(CLIP).to(tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(G + goff + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_CLIP:
            g = g / clip
        p = tl.load(P + pos + idx, mask=mask, other=0.0)
        m = tl.load(M + pos + idx, mask=mask, other=0.0)
        v = tl.load(V + pos + idx, mask=mask, other=0.0)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(P + pos + idx, p, mask=mask)
        tl.store(M + pos + idx, m, mask=mask)
        tl.store(V + pos + idx, v, mask=mask)
        tl.store(OUT + pos + idx, p.to(OUT.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=16)
def _tensor_table(starts: tuple[int, ...], goffs: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-gradient offsets on the device. Cached: the caching allocator mostly puts a
    step's gradients where the last step's were. Copied from pinned memory, without waiting for the
    GPU's queue (from pageable memory the copy synchronised: benchmarks/results/host-waits-moe-2b-h200.json)."""
    host = torch.tensor([starts, goffs], dtype=torch.int64)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return table[0], table[1]


def adamw_master_fused(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       weight16: torch.Tensor, segments: list[tuple[int, torch.Tensor]], step: torch.Tensor, lr: float,
                       beta1: float, beta2: float, eps: float, weight_decay: float, clip: torch.Tensor | None,
                       block: int = _BLOCK, num_warps: int = 8, hint_numel: bool = True) -> None:
    """``segments``: (offset along the flat vectors, gradient) of each gradient (``adamw_master.segments``).
    ``block``, ``num_warps`` and ``hint_numel`` (tell the compiler that every gradient's size is a
    multiple of 16, where it is): the launch, which ``benchmarks/adamw_master_bench.py`` sweeps."""
    segments = [(start, g) for start, g in segments if g.numel()]
    if not segments:
        return
    starts, grads = zip(*segments)
    if len({g.dtype for g in grads}) != 1 or not all(g.is_contiguous() for g in grads):
        raise ValueError("adamw_master_fused: the gradients must share one dtype and be contiguous")
    for name, x in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"adamw_master_fused: {name} must be a contiguous fp32 vector, got {x.dtype}")
    numels = tuple(g.numel() for g in grads)
    goffs = tuple(element_offsets(grads))
    chunk_tensor, chunk_start, _, numel = chunk_layout(numels, master.device)
    pos, goff = _tensor_table(starts, goffs, master.device)
    aligned = (all(x.data_ptr() % 64 == 0 for x in (master, exp_avg, exp_avg_sq, weight16, grads[0]))
               and all(p % 16 == 0 for p in starts) and all(o % 16 == 0 for o in goffs))
    # the mask of a chunk's tail is otherwise unknown to the compiler, which then loads and stores
    # one element at a time: 3.04 TB/s on moe-gpu-2b's 2.17B parameters (one H200)
    n_aligned = hint_numel and CHUNK % 16 == 0 and all(n % 16 == 0 for n in numels)
    _adamw_master_kernel[(len(chunk_tensor),)](
        chunk_tensor, chunk_start, pos, goff, numel, master, exp_avg, exp_avg_sq, weight16, grads[0], step,
        clip if clip is not None else step,
        float(lr), float(beta1), float(beta2), math.log(beta1), math.log(beta2), float(eps), float(weight_decay),
        HAS_CLIP=clip is not None, ALIGNED=aligned, N_ALIGNED=n_aligned, CHUNK=CHUNK, BLOCK=block, num_warps=num_warps,
    )

