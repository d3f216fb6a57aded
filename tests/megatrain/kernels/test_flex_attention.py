"""FlexAttention sliding window vs the explicit reference. (The mask itself equals a brute force:
tests/megatrain/model/test_attention.py.)

GPU tolerances (relative error against float64 of the same inputs): bf16 outputs and grads
within 2x (+1e-3) of the bf16 reference's own error.
"""

import pytest
import torch

from megatrain.kernels.attention import attention_reference, causal_attention

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _qkv(B, H, T, hd, dtype, device, seed=0, requires_grad=False):
    g = torch.Generator(device).manual_seed(seed)
    return [torch.randn(B, H, T, hd, generator=g, device=device).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.parametrize("window", [None, 1, 64, 100])
def test_flex_forward_matches_reference_on_cpu(window):
    """CPU flex is eager (dense math, no backward): a check of the block mask and the window
    convention, not of speed."""
    from megatrain.kernels.flex_attention import attention_flex

    q, k, v = _qkv(1, 2, 256, 16, torch.float32, "cpu")
    torch.testing.assert_close(attention_flex(q, k, v, window), attention_reference(q, k, v, window),
                               rtol=1e-5, atol=1e-5)


def test_block_masks_are_cached_per_shape_and_window():
    from megatrain.kernels.flex_attention import block_mask_for

    a = block_mask_for(256, 64, torch.device("cpu"))
    assert block_mask_for(256, 64, torch.device("cpu")) is a
    assert block_mask_for(256, 128, torch.device("cpu")) is not a
    # a window >= T is full causal and shares its entry
    assert block_mask_for(256, 256, torch.device("cpu")) is block_mask_for(256, None, torch.device("cpu"))


def test_sliding_window_block_mask_skips_blocks():
    from megatrain.kernels.flex_attention import block_mask_for

    full = block_mask_for(2048, None, torch.device("cpu"))
    window = block_mask_for(2048, 256, torch.device("cpu"))
    # 16 x 16 tiles of 128: causal keeps 136, a 256 window at most 3 per query tile
    assert window.sparsity() > full.sparsity() + 30


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T, window", [(256, None), (256, 64), (1024, 128), (1024, 200), (2048, 512), (2048, 1024)])
def test_flex_matches_reference_forward_and_backward(T, window):
    q, k, v = _qkv(2, 4, T, 64, torch.bfloat16, "cuda", seed=T, requires_grad=True)
    dout = torch.randn_like(q)

    def run(fn, q, k, v, dout):
        out = fn(q, k, v)
        return [out, *torch.autograd.grad(out, [q, k, v], dout)]

    flex = run(lambda q, k, v: causal_attention(q, k, v, window, "flex"), q, k, v, dout)
    ref = run(lambda q, k, v: attention_reference(q, k, v, window), q, k, v, dout)
    exact = run(lambda q, k, v: attention_reference(q, k, v, window),
                *[x.detach().double().requires_grad_() for x in (q, k, v)], dout.double())
    for name, got, r, e in zip(["out", "dq", "dk", "dv"], flex, ref, exact):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        err, ref_err = rel_err(got, e), rel_err(r, e)
        assert err <= 2 * ref_err + 1e-3, f"{name}: flex error {err:.2e}, reference's own {ref_err:.2e}"


@pytest.mark.gpu
@requires_cuda
def test_auto_and_sdpa_route_windows_to_flex_on_cuda(monkeypatch):
    import megatrain.kernels.flex_attention as flex

    calls = []
    real = flex.attention_flex
    monkeypatch.setattr(flex, "attention_flex", lambda *a: calls.append(a[3]) or real(*a))
    q, k, v = _qkv(1, 2, 512, 64, torch.bfloat16, "cuda")
    causal_attention(q, k, v, 128, "auto")
    causal_attention(q, k, v, 128, "sdpa")
    causal_attention(q, k, v, None, "auto")  # full causal stays on SDPA
    assert calls == [128, 128]
