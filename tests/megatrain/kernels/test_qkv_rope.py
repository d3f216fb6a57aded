"""The attention input's one-pass split and rotation (kernels/rope.qkv_rope): the Triton Function
against the reference (split, then the rotation of q and k), forward and qkv's gradient, on a GPU
and in Triton's interpreter, on a contiguous qkv and on a strided view of a wider projection."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.kernels.rope import qkv_rope, rope_inv_freq, rope_tables

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _compare(device: str, dtype: torch.dtype, B: int, T: int, H: int, G: int, hd: int, strided: bool) -> None:
    g = torch.Generator().manual_seed(B * T + H)
    width = (H + 2 * G) * hd
    base = torch.randn(B, T, width + (3 * hd if strided else 0), generator=g).to(device, dtype)
    qkv = base[..., hd:hd + width] if strided else base  # the parallel block's fused projection is a view
    cos, sin = rope_tables(rope_inv_freq(hd, 10000.0, device=torch.device(device)), T, 0)
    grads = [torch.randn(B, n, T, hd, generator=g).to(device, dtype) for n in (H, G, G)]
    outs = {}
    for impl in ("fused", "reference"):
        x = qkv.detach().requires_grad_()  # a leaf with qkv's strides, its own gradient per run
        q, k, v = qkv_rope(x, cos, sin, H, G, hd, impl)
        # dq laid out as SDPA's backward may give it: tokens-first for q, head-major for k and v
        dq = grads[0].transpose(1, 2).contiguous().transpose(1, 2)
        torch.autograd.backward([q, k, v], [dq, grads[1], grads[2]])
        outs[impl] = (q.detach(), k.detach(), v.detach(), x.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in zip(("q", "k", "v", "dqkv"), outs["fused"], outs["reference"]):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
    q = outs["fused"][0]
    assert q.transpose(1, 2).is_contiguous()  # stored tokens-first: the attention output's layout too


SHAPES = [(2, 33, 4, 2, 16, False), (1, 70, 2, 1, 8, True), (2, 64, 4, 4, 32, True), (1, 40, 3, 1, 24, False)]
# B, T, H, G, hd (24: half-rows narrower than their block), strided


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, G, hd, strided", SHAPES + [(2, 2048, 16, 8, 64, False)])
def test_fused_matches_reference(dtype, B, T, H, G, hd, strided):
    _compare("cuda", dtype, B, T, H, G, hd, strided)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("B, T, H, G, hd, strided", SHAPES)
def test_fused_in_the_triton_interpreter(B, T, H, G, hd, strided):
    _compare("cpu", torch.float32, B, T, H, G, hd, strided)
