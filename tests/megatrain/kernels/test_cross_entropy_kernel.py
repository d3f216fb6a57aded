"""LM head + cross-entropy: chunked vs reference on CPU (fp32: loss and grads within 1e-5);
fused (chunked + Triton) and chunked vs reference on GPU, plus peak memory."""

import os

import pytest
import torch

from megatrain.kernels.cross_entropy import (
    IGNORE_INDEX,
    default_chunk_rows,
    lm_head_cross_entropy,
    lm_head_cross_entropy_chunked,
    lm_head_cross_entropy_reference,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _problem(N=96, d=32, V=203, dtype=torch.float32, device="cpu", seed=0, ignore=(3, 50)):
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(N, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(V, d, generator=g, device=device)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g, device=device)
    for i in ignore:
        if i < N:
            targets[i] = IGNORE_INDEX
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets, scale=1.0):
    loss = fn(hidden, weight, targets)
    dh, dw = torch.autograd.grad(loss * scale, [hidden, weight])
    return loss, dh, dw


@pytest.mark.parametrize("chunk_rows", [1, 7, 32, 96, 1000, None])
def test_chunked_matches_reference_fp32(chunk_rows):
    h, w, t = _problem()
    ref = _loss_and_grads(lm_head_cross_entropy_reference, h, w, t, scale=2.5)
    got = _loss_and_grads(lambda *a: lm_head_cross_entropy_chunked(*a, chunk_rows=chunk_rows), h, w, t, scale=2.5)
    for name, a, b in zip(["loss", "dhidden", "dweight"], got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_dispatch_routes_chunked_and_auto_is_reference_on_cpu():
    h, w, t = _problem(seed=1)
    ref = lm_head_cross_entropy_reference(h, w, t)
    torch.testing.assert_close(lm_head_cross_entropy(h, w, t, "chunked"), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm_head_cross_entropy(h, w, t, "auto"), ref)


def test_chunked_backward_twice_with_retain_graph():
    """Gradients are computed in the forward and scaled in the backward: a second backward must
    see them unchanged."""
    h, w, t = _problem(seed=2)
    loss = lm_head_cross_entropy_chunked(h, w, t, chunk_rows=16)
    first = torch.autograd.grad(loss, [h, w], retain_graph=True)
    second = torch.autograd.grad(3 * loss, [h, w])
    for a, b in zip(first, second):
        torch.testing.assert_close(3 * a, b)


def test_chunked_without_grad_and_with_one_leaf():
    h, w, t = _problem(seed=3)
    ref = lm_head_cross_entropy_reference(h, w, t)
    with torch.no_grad():
        torch.testing.assert_close(lm_head_cross_entropy_chunked(h, w, t, chunk_rows=10), ref, rtol=1e-5, atol=1e-5)
    frozen = w.detach()
    loss = lm_head_cross_entropy_chunked(h, frozen, t, chunk_rows=10)
    (dh,) = torch.autograd.grad(loss, [h])
    (dh_ref,) = torch.autograd.grad(lm_head_cross_entropy_reference(h, frozen, t), [h])
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-5)


def test_chunked_under_cpu_autocast_stays_close():
    h, w, t = _problem(seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(lambda *a: lm_head_cross_entropy_chunked(*a, chunk_rows=32), h, w, t)
        ref = _loss_and_grads(lm_head_cross_entropy_reference, h, w, t)
    assert got[0].dtype == torch.float32 and got[1].dtype == h.dtype and got[2].dtype == w.dtype
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 2e-2


def test_default_chunk_rows_bounds_the_chunk():
    # up to 2^32 logits: the whole micro-batch (Llama-3.2-1B at 16 x 2048 tokens, GPT 1.3B at 8 x 2048)
    assert default_chunk_rows(16384, 50304) == 16384
    assert default_chunk_rows(32768, 128256) == 32768
    assert default_chunk_rows(10, 50304) == 10
    # beyond: powers of two of at most 2^28 logits, at least 4096 rows for large vocabularies
    assert default_chunk_rows(65536, 128256) == 4096
    assert default_chunk_rows(131072, 50304) == 4096
    assert default_chunk_rows(10**6, 2**30) == 1


def test_one_chunk_weight_gradient_is_the_compute_dtype_matmul_of_its_dlogits(monkeypatch):
    """One chunk: dW is the product of dlogits and h in the compute dtype, as the reference's
    (bf16 under autocast); several chunks sum their products in fp32. Both close to the reference."""
    import megatrain.kernels.cross_entropy as ce

    h, w, t = _problem(N=64, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(lm_head_cross_entropy_reference, h, w, t)
        one = _loss_and_grads(lm_head_cross_entropy_chunked, h, w, t)  # 64 x 203 logits: one chunk
        monkeypatch.setattr(ce, "ONE_CHUNK_LOGITS", 0)
        assert default_chunk_rows(64, 203) == 64  # 2^28 logits per chunk: still one chunk here
        several = _loss_and_grads(lambda *a: lm_head_cross_entropy_chunked(*a, chunk_rows=16), h, w, t)
    for a, b, c in zip(one, several, ref):
        assert rel_err(a, c) < 2e-2 and rel_err(b, c) < 2e-2
    # the one-chunk dW is exactly the bf16 matmul of its own dlogits: recompute it
    logits = (h.detach().bfloat16() @ w.detach().bfloat16().t()).float()
    valid = (t != IGNORE_INDEX).float()[:, None]
    dlogits = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(t.clamp_min(0), 203)) * valid / valid.sum()
    want = (dlogits.bfloat16().t() @ h.detach().bfloat16()).float()
    torch.testing.assert_close(one[2], want, rtol=0, atol=0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("impl", ["fused", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, d, V", [(1024, 256, 8192), (777, 128, 50304), (64, 64, 1001)])
def test_gpu_matches_reference(impl, dtype, N, d, V):
    h, w, t = _problem(N, d, V, dtype, "cuda", seed=N)
    got = _loss_and_grads(lambda *a: lm_head_cross_entropy(*a, impl=impl), h, w, t, scale=0.5)
    ref = _loss_and_grads(lm_head_cross_entropy_reference, h, w, t, scale=0.5)
    exact = _loss_and_grads(lm_head_cross_entropy_reference,
                            h.detach().double().requires_grad_(), w.detach().double().requires_grad_(), t, 0.5)
    for name, a, r, e in zip(["loss", "dhidden", "dweight"], got, ref, exact):
        assert a.dtype == r.dtype and torch.isfinite(a).all(), name
        err, ref_err = rel_err(a, e), rel_err(r, e)
        # fp32 matmuls may run as TF32 in either version; bf16: no worse than twice torch's own.
        limit = 1e-4 if dtype == torch.float32 else 2 * ref_err + 1e-4
        assert err <= limit, f"{name}: error {err:.2e} > {limit:.2e} (reference's own: {ref_err:.2e})"


@pytest.mark.gpu
@requires_cuda
def test_fused_uses_a_fraction_of_the_reference_memory():
    from megatrain.kernels.cross_entropy import lm_head_cross_entropy_fused

    h, w, t = _problem(8192, 1024, 50304, torch.bfloat16, "cuda", seed=5)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        return torch.cuda.max_memory_allocated() - base

    ref = peak(lm_head_cross_entropy_reference)
    chunked = peak(lambda *a: lm_head_cross_entropy_fused(*a, chunk_rows=2048))
    whole = peak(lambda *a: lm_head_cross_entropy(*a, impl="fused"))  # 8192 x 50304 < 2^32 logits: one chunk
    # reference: bf16 + fp32 logits (8192 x 50304) = 2.5 GB; 2048-row chunks: one bf16 chunk + fp32 dW;
    # one chunk: the bf16 logits (overwritten by their gradient) + bf16 dW
    assert chunked < ref / 4, (chunked, ref)
    assert whole < 0.5 * ref, (whole, ref)



def _compare_chunk_kernel(device: str, dtype: torch.dtype) -> None:
    """The Triton chunk function against the plain-torch one: loss and dlogits, ignored rows
    included, on a vocabulary that is not a multiple of the kernel's block."""
    from megatrain.kernels.cross_entropy import softmax_cross_entropy_chunk
    from megatrain.kernels.cross_entropy_triton import softmax_cross_entropy_chunk_triton

    g = torch.Generator().manual_seed(3)
    rows, vocab = 37, 5001
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(device, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[[2, 30]] = IGNORE_INDEX
    targets = targets.to(device)
    scale = torch.tensor(1 / 35.0, device=device)
    want_loss, want_grad = softmax_cross_entropy_chunk(logits.clone(), targets, scale, True)
    loss, grad = softmax_cross_entropy_chunk_triton(logits.clone(), targets, scale, True, IGNORE_INDEX)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(loss, want_loss, **tol)
    torch.testing.assert_close(grad.float(), want_grad.float(), **tol)
    assert grad[2].abs().max() == 0 and grad[30].abs().max() == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kernel_matches_torch(dtype):
    _compare_chunk_kernel("cuda", dtype)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
def test_chunk_kernel_in_the_triton_interpreter():
    _compare_chunk_kernel("cpu", torch.float32)
