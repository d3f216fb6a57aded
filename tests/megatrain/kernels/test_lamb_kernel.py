"""The multi-tensor Triton LAMB step vs a per-tensor plain-torch LAMB, on GPU.

fp32: parameters and moments within rtol 1e-5 / atol 1e-6 after several steps (the norms are
summed in a different order, and Triton may contract a*b + c into one FMA).
"""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HYPER = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1, max_trust_ratio=10.0)


def lamb_step_per_tensor(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
                         max_trust_ratio):
    """The reference math, one tensor at a time, in fp32."""
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g32 = g.float()
        m32 = beta1 * m.float() + (1 - beta1) * g32
        v32 = beta2 * v.float() + (1 - beta2) * g32 * g32
        u = (m32 / (1 - beta1**step)) / ((v32 / (1 - beta2**step)).sqrt() + eps) + weight_decay * p.float()
        w_norm, u_norm = p.float().norm(), u.norm()
        trust = torch.where((w_norm > 0) & (u_norm > 0), (w_norm / u_norm).clamp(max=max_trust_ratio),
                            torch.ones_like(w_norm))
        p.copy_(p.float() - lr * trust * u)
        m.copy_(m32)
        v.copy_(v32)


def _state(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    params = [torch.randn(s, generator=g, device="cuda").to(dtype) for s in shapes]
    zeros = lambda: [torch.zeros(s, device="cuda", dtype=dtype) for s in shapes]  # noqa: E731
    return params, zeros(), zeros()


# Sizes around the 64K-element chunk, a scalar, odd sizes, and an all-zero tensor (trust = 1).
SHAPES = [(300, 700), (2 * 65536 + 5,), (65536,), (1,), (17, 3), (4096,), (33,)]


def _run(fused_params, ref_params, shapes, grad_dtype=torch.float32, steps=3):
    from megatrain.kernels.lamb_triton import lamb_step_fused

    p1, m1, v1 = fused_params
    p2, m2, v2 = ref_params
    g = torch.Generator("cuda").manual_seed(123)
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=g, device="cuda").to(grad_dtype) for s in shapes]
        lamb_step_fused(p1, grads, m1, v1, step=step, **HYPER)
        lamb_step_per_tensor(p2, grads, m2, v2, step=step, **HYPER)
    for name, a, b in (("param", p1, p2), ("exp_avg", m1, m2), ("exp_avg_sq", v1, v2)):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name}[{i}] {tuple(x.shape)}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_lamb_matches_per_tensor_reference(grad_dtype):
    state = _state(SHAPES)
    state[0][4].zero_()
    ref = tuple([t.clone() for t in lst] for lst in state)
    _run(state, ref, SHAPES, grad_dtype)


@pytest.mark.gpu
@requires_cuda
def test_fused_lamb_on_unaligned_views():
    """Views into one flat buffer at odd offsets: no 16-byte alignment, the unhinted path."""
    sizes = [5, 1000, 70001, 3]
    flat = [torch.randn(sum(sizes) + 1, device="cuda") for _ in range(3)]
    flat[1].zero_()
    flat[2].zero_()

    def views(buf):
        out, start = [], 1  # offset 1: 4-byte aligned only
        for n in sizes:
            out.append(buf[start:start + n])
            start += n
        return out

    state = tuple(views(b) for b in flat)
    ref = tuple([t.clone() for t in lst] for lst in state)
    _run(state, ref, [(n,) for n in sizes])


@pytest.mark.gpu
@requires_cuda
def test_fused_lamb_rejects_mismatched_lists():
    from megatrain.kernels.lamb_triton import lamb_step_fused

    p, m, v = _state([(4,), (5,)])
    with pytest.raises(ValueError):
        lamb_step_fused(p, [torch.zeros(4, device="cuda")], m, v, step=1, **HYPER)
    with pytest.raises(ValueError):
        lamb_step_fused(p, [torch.zeros(4, device="cuda"), torch.zeros(5, device="cuda")], m, v, step=0, **HYPER)
