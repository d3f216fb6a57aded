"""Fused rotary embedding in Triton, forward and backward (one kernel, two signs).

x is [B, H, T, hd] with any strides (q and k arrive as transposed views of the qkv projection's
output: reading them in place spares a copy); the output is a contiguous [B, H, T, hd]. Each
program rotates BLOCK_T positions of one (batch, head): it loads the two halves of every row and
the [BLOCK_T, hd/2] cos/sin tile (fp32), and writes both rotated halves. The backward is the same
kernel rotating by the opposite angle (sin negated), on the incoming gradient.

Measured on an H200 for q of Llama-3.2-1B ([8, 32, 2048, 64] bf16 seen through a transpose;
benchmarks/kernels.py, CUDA graph): forward + backward 0.069 ms, 92% of the copy rate; the
reference under torch.compile 0.505 ms. Inside compiled blocks ``auto`` still leaves RoPE to
inductor, which fuses it with the q/k split and layout copies around it: in the Llama-3.2-1B
training step on an H200 (mb 16, benchmarks/mfu.py) the Triton kernel there gave 70,438 against
70,393 tokens/s, within the run-to-run spread.

``qkv_rope_fused`` (below) does the attention input's split and rotation in one pass from the
fused qkv projection, and its gradient in one pass back (``rope.qkv_rope``).

This module imports Triton at the top: ``megatrain.kernels.rope`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32


@triton.jit
def _rope_kernel(X, COS, SIN, Y, H, T, sxb, sxh, sxt, SIGN: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_HALF)
    mask = (t < T)[:, None] & (c < HALF)[None, :]
    x_offs = b * sxb + h * sxh + t.to(tl.int64)[:, None] * sxt + c[None, :]
    x1 = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    table = t[:, None] * HALF + c[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0) * SIGN
    y_offs = (bh * T + t.to(tl.int64))[:, None] * (2 * HALF) + c[None, :]
    tl.store(Y + y_offs, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_offs + HALF, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    B, H, T, hd = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((B, H, T, hd), dtype=x.dtype, device=x.device)
    half = hd // 2
    _rope_kernel[(B * H, triton.cdiv(T, BLOCK_T))](
        x, cos, sin, y, H, T, x.stride(0), x.stride(1), x.stride(2), SIGN=sign, HALF=half,
        BLOCK_T=BLOCK_T, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )
    return y


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, -1.0), None, None


def rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated by cos, sin [T, hd/2] (rotate-half layout, see rope.py)."""
    return _RopeFn.apply(x, cos, sin)


# The attention input in one pass each way (``rope.qkv_rope``): the fused projection's output
# qkv [B, T, (H + 2G) hd] -> q, k rotated and v, each stored tokens-first ([B, T, heads, hd], seen
# as [B, heads, T, hd]); the backward writes the projection's gradient dqkv from dq, dk (rotated
# back) and dv in one kernel. One program moves BLOCK_ROWS tokens of one head.
QKV_BLOCK_ROWS = 64


@triton.jit
def _rotated_halves(SRC, COS, SIN, t, c, mask, rotate, sign, HALF: tl.constexpr):
    """The two halves of [rows, hd] at SRC (columns c of each half), rotated by sign x the angles of
    positions t; unrotated (v) where ``rotate`` is false, without reading the tables."""
    x1 = tl.load(SRC, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(SRC + HALF, mask=mask, other=0.0).to(tl.float32)
    table = t[:, None] * HALF + c[None, :]
    cos = tl.load(COS + table, mask=mask & rotate, other=1.0)
    sin = tl.load(SIN + table, mask=mask & rotate, other=0.0) * sign
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _qkv_rope_fwd_kernel(QKV, COS, SIN, Q, K, V, n_rows, T, s_b, s_t, n_head, n_kv, HALF: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    head = tl.program_id(1)  # 0 .. H + 2G - 1: q heads, then k heads, then v heads
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # b T + t
    t = rows % T
    c = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (c < HALF)[None, :]
    src = QKV + ((rows // T).to(tl.int64) * s_b + t.to(tl.int64) * s_t)[:, None] + head * (2 * HALF) + c[None, :]
    y1, y2 = _rotated_halves(src, COS, SIN, t, c, mask, head < n_head + n_kv, 1.0, HALF)
    row64 = rows.to(tl.int64)[:, None]
    if head < n_head:
        dst = Q + row64 * (n_head * 2 * HALF) + head * (2 * HALF) + c[None, :]
    elif head < n_head + n_kv:
        dst = K + row64 * (n_kv * 2 * HALF) + (head - n_head) * (2 * HALF) + c[None, :]
    else:
        dst = V + row64 * (n_kv * 2 * HALF) + (head - n_head - n_kv) * (2 * HALF) + c[None, :]
    tl.store(dst, y1.to(Q.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_rope_bwd_kernel(DQ, DK, DV, COS, SIN, DQKV, n_rows, T, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                         n_head, n_kv, HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    b, t = (rows // T).to(tl.int64), rows % T
    c = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (c < HALF)[None, :]
    if head < n_head:  # the gradients arrive in whatever layout SDPA's backward gave them
        src = DQ + (b * sq_b + head * sq_h + t.to(tl.int64) * sq_t)[:, None] + c[None, :]
    elif head < n_head + n_kv:
        src = DK + (b * sk_b + (head - n_head) * sk_h + t.to(tl.int64) * sk_t)[:, None] + c[None, :]
    else:
        src = DV + (b * sv_b + (head - n_head - n_kv) * sv_h + t.to(tl.int64) * sv_t)[:, None] + c[None, :]
    # the rotation's backward is the rotation by the opposite angle
    g1, g2 = _rotated_halves(src, COS, SIN, t, c, mask, head < n_head + n_kv, -1.0, HALF)
    dst = DQKV + rows.to(tl.int64)[:, None] * ((n_head + 2 * n_kv) * 2 * HALF) + head * (2 * HALF) + c[None, :]
    tl.store(dst, g1.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, g2.to(DQKV.dtype.element_ty), mask=mask)


def _qkv_launch(B: int, T: int, n_head: int, n_kv: int, hd: int) -> tuple[tuple[int, int], dict]:
    grid = (triton.cdiv(B * T, QKV_BLOCK_ROWS), n_head + 2 * n_kv)
    return grid, {"HALF": hd // 2, "BLOCK_ROWS": QKV_BLOCK_ROWS, "BLOCK_HALF": triton.next_power_of_2(hd // 2),
                  "num_warps": 4}


class _QKVRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int, hd: int):
        B, T, width = qkv.shape
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        q = torch.empty((B, T, n_head, hd), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((B, T, n_kv, hd), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty((B, T, n_kv, hd), dtype=qkv.dtype, device=qkv.device)
        grid, options = _qkv_launch(B, T, n_head, n_kv, hd)
        _qkv_rope_fwd_kernel[grid](qkv, cos, sin, q, k, v, B * T, T, qkv.stride(0), qkv.stride(1), n_head, n_kv,
                                   **options)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, width, n_head, n_kv, hd)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        B, T, width, n_head, n_kv, hd = ctx.shape
        dq, dk, dv = [g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv)]  # [B, heads, T, hd]
        dqkv = torch.empty((B, T, width), dtype=dq.dtype, device=dq.device)
        grid, options = _qkv_launch(B, T, n_head, n_kv, hd)
        _qkv_rope_bwd_kernel[grid](dq, dk, dv, cos, sin, dqkv, B * T, T, dq.stride(0), dq.stride(1), dq.stride(2),
                                   dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                                   n_head, n_kv, **options)
        return dqkv, None, None, None, None, None


def qkv_rope_fused(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2G) hd] -> q [B, H, T, hd] and k [B, G, T, hd] rotated by cos, sin [T, hd/2],
    v [B, G, T, hd], each stored tokens-first (``rope.qkv_rope``'s contract)."""
    return _QKVRopeFn.apply(qkv, cos, sin, n_head, n_kv, head_dim)
