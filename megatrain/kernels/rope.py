"""Rotary position embedding (Su et al. 2021), Hugging Face's "rotate half" layout.

Feature i of a head is paired with feature i + hd/2, and the pair is rotated by the angle
position * inv_freq[i]:

    y[i]        = x[i] cos - x[i + hd/2] sin
    y[i + hd/2] = x[i + hd/2] cos + x[i] sin

which is the complex product (x[i] + j x[i + hd/2]) * e^(j angle). (Meta's original code pairs
adjacent features 2i, 2i+1; a checkpoint converts between the two by permuting the rows of the
q and k projections, which Hugging Face's conversion does.) The rotation is computed in fp32 and
rounded once. Its backward is the rotation by the opposite angle.

``rope_tables`` builds cos and sin [T, hd/2] (fp32) for positions offset .. offset + T - 1;
``rope_inv_freq`` gives the frequencies, with Llama 3's or YaRN's scaling when the config asks for
it (YaRN also multiplies cos and sin by its attention factor, ``rope_scale``).
"""

from __future__ import annotations

import math

import torch

from megatrain.kernels import resolve


def rope_inv_freq(head_dim: int, theta: float, scaling=None, device: torch.device | None = None) -> torch.Tensor:
    """[hd/2] fp32 angular frequencies theta^(-2i/hd); ``scaling`` (config.model.RopeScaling or
    YarnScaling, told apart by ``rope_type``) applies Llama 3's rule (keep high frequencies,
    divide low ones by ``factor``, interpolate the band between) or YaRN's (``_yarn``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return inv_freq
    if getattr(scaling, "rope_type", "llama3") == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    old = scaling.original_max_position
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023, as transformers computes them): dimension pair i
    turns original_max_position * inv_freq[i] / 2 pi times over the original context. The pair
    index d(r) at which it turns r times is hd ln(L / (2 pi r)) / (2 ln theta); pairs below
    d(beta_fast) (fast, many turns) keep inv_freq, pairs above d(beta_slow) take inv_freq / factor,
    and a linear ramp over the pair index blends the two between (ends rounded outwards when
    ``truncate``, clamped to [0, hd - 1])."""
    def turns_at(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_at(s.beta_fast), turns_at(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width: transformers' guard against dividing by zero
    pair = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    interpolated = ((pair - low) / (high - low)).clamp(0, 1)  # 0: keep the frequency, 1: divide it by factor
    return inv_freq / s.factor * interpolated + inv_freq * (1 - interpolated)


def rope_scale(scaling=None) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor (which so scales every
    logit q.k by its square), 1 otherwise."""
    return float(scaling.attention_scale) if getattr(scaling, "rope_type", None) == "yarn" else 1.0


def rope_tables(inv_freq: torch.Tensor, seq_len: int, offset: int = 0,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, hd/2] fp32 for positions offset .. offset + T - 1, times ``scale`` (rope_scale)."""
    positions = torch.arange(offset, offset + seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [T, hd/2]
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated by the angles of cos, sin [T, hd/2]."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)  # [B, H, T, hd/2] each, >= fp32
    y = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    if resolve(impl, x) == "fused":
        from megatrain.kernels.rope_triton import rope_fused

        return rope_fused(x, cos, sin)
    return rope_reference(x, cos, sin)


def split_qkv(qkv: torch.Tensor, n_head: int, n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2G) hd] (the fused input projection's output) -> views q [B, H, T, hd],
    k and v [B, G, T, hd]. split, not unbind: the backward is then one concatenation of dq, dk, dv
    (which inductor writes straight into the fused projection's gradient buffer)."""
    return tuple(t.unflatten(-1, (-1, head_dim)).transpose(1, 2)
                 for t in qkv.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1))


def qkv_rope_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int,
                       head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2G) hd] -> q [B, H, T, hd] and k [B, G, T, hd] rotated by cos, sin [T, hd/2],
    and v [B, G, T, hd]."""
    q, k, v = split_qkv(qkv, n_head, n_kv, head_dim)
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin), v


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv: int, head_dim: int,
             impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv_rope_reference``'s contract. Fused (Triton), one kernel reads qkv once and writes q, k
    and v stored tokens-first, and one writes qkv's gradient from dq, dk and dv: inductor's kernels
    for the same (split, rotation, the tokens-first layout, and the concatenation of the
    gradients) moved each byte about twice in moe-gpu-2b's step on an H200. Fused under
    torch.compile too (``resolve(..., under_compile=None)``)."""
    if resolve(impl, qkv, under_compile=None) == "fused":
        from megatrain.kernels.rope_triton import qkv_rope_fused

        return qkv_rope_fused(qkv, cos, sin, n_head, n_kv, head_dim)
    return qkv_rope_reference(qkv, cos, sin, n_head, n_kv, head_dim)
