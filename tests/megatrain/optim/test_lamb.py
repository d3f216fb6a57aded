import math

import pytest
import torch

from megatrain.config import OptimConfig
from megatrain.optim import Lamb, TensorSegments, lr_at


def lamb_reference(params, grads_per_step, lr, betas, eps, wd, max_trust):
    """A straightforward per-tensor LAMB, one tensor and one step at a time."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat = m[i] / (1 - betas[0] ** t)
            v_hat = v[i] / (1 - betas[1] ** t)
            update = m_hat / (v_hat.sqrt() + eps) + wd * p
            w_norm, u_norm = p.norm().item(), update.norm().item()
            trust = min(w_norm / u_norm, max_trust) if w_norm > 0 and u_norm > 0 else 1.0
            params[i] = p - lr * trust * update
    return params


def _random_problem(seed=0, steps=4):
    g = torch.Generator().manual_seed(seed)
    shapes = [(17, 9), (9,), (3, 4, 5), (1,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    params[3].zero_()  # a zero tensor takes trust ratio 1
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("wd, max_trust", [(0.0, 10.0), (0.1, 10.0), (0.01, 0.5)])
def test_lamb_matches_per_tensor_reference(wd, max_trust):
    params, grads = _random_problem()
    expected = lamb_reference(params, grads, lr=0.01, betas=(0.9, 0.99), eps=1e-6, wd=wd, max_trust=max_trust)
    tensors = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lamb(tensors, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, max_trust_ratio=max_trust)
    for step_grads in grads:
        for p, g in zip(tensors, step_grads):
            p.grad = g.clone()
        opt.step()
    for got, want in zip(tensors, expected):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-6)


def test_lamb_on_a_flat_partition_with_segments_keeps_per_tensor_trust():
    """What ZeRO does: one flat tensor, with segments telling LAMB where each model tensor lies."""
    params, grads = _random_problem(seed=1)
    expected = lamb_reference(params, grads, lr=0.02, betas=(0.9, 0.95), eps=1e-8, wd=0.1, max_trust=10.0)
    flat = torch.nn.Parameter(torch.cat([p.flatten() for p in params]))
    starts = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    spans = [(starts[i], p.numel(), i) for i, p in enumerate(params)]
    # tensor 0 split in two spans, as a partition boundary can cut a tensor: norms still per tensor
    spans = [(0, 50, 0), (50, params[0].numel() - 50, 0), *spans[1:]]
    opt = Lamb([flat], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.set_tensor_segments(flat, TensorSegments(spans=spans, num_tensors=len(params), group=None))
    for step_grads in grads:
        flat.grad = torch.cat([g.flatten() for g in step_grads])
        opt.step()
    torch.testing.assert_close(flat.detach(), torch.cat([p.flatten() for p in expected]), atol=1e-6, rtol=1e-6)


def test_lamb_state_is_checkpointable():
    params, grads = _random_problem()
    p = torch.nn.Parameter(params[0].clone())
    opt = Lamb([p], lr=0.01)
    p.grad = grads[0][0]
    opt.step()
    state = opt.state_dict()
    assert state["state"][0]["step"].item() == 1
    other = Lamb([torch.nn.Parameter(params[0].clone())], lr=0.01)
    other.load_state_dict(state)
    assert torch.equal(other.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_warmup_then_cosine_schedule():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)
    steps = [lr_at(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))
    assert math.isclose(lr_at(50, OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="constant"), 100), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_lamb_over_spans_matches_foreach_on_cpu():
    """On CUDA a segmented flat partition goes through the Triton kernels (one view per span,
    span norms combined per model tensor); on CPU through the foreach path. Same result (fp32)."""
    # tensor ids out of order, tensor 2 cut in two spans, 7 padding elements at the end
    spans = [(0, 50000, 2), (50000, 20001, 2), (70001, 3, 0), (70004, 1000, 1)]
    numel = 71011
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(numel, generator=g)
    w0[71004:] = 0
    grads = []
    for _ in range(3):
        grad = torch.randn(numel, generator=g)
        grad[71004:] = 0
        grads.append(grad)
    results = []
    for device in ("cpu", "cuda"):
        w = torch.nn.Parameter(w0.clone().to(device))
        opt = Lamb([w], lr=0.01, weight_decay=0.1, max_trust_ratio=10.0)
        opt.set_tensor_segments(w, TensorSegments(spans=spans, num_tensors=3, group=None))
        for grad in grads:
            w.grad = grad.to(device)
            opt.step()
        results.append((w.detach().cpu(), opt.state[w]["exp_avg"].cpu(), opt.state[w]["exp_avg_sq"].cpu()))
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda, cpu, rtol=1e-5, atol=1e-6)
