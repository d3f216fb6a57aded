"""AdamW on fp32 masters from 16-bit gradients (megatrain/kernels/adamw_master.py): the reference
against torch's own AdamW over the same steps on CPU; the Triton kernel against the reference on a
GPU and in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.kernels.adamw_master import AdamWHyper, adamw_master_step

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HYPER = AdamWHyper(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SHAPES = [(64, 48), (7,), (3, 5, 33), (70_000,)]  # the last spans two of the kernel's chunks
# every size a multiple of 16: the kernel is told so (vectorised chunk tails); the last spans two chunks
SHAPES_16 = [(64, 48), (16,), (3, 16, 32), (70_016,)]


def _problem(device: str, grad_dtype: torch.dtype, pad: int = 5, shapes=SHAPES):
    g = torch.Generator().manual_seed(11)
    n = sum(torch.Size(s).numel() for s in shapes)
    master = torch.randn(n + pad, generator=g)  # a padded partition: the tail is no gradient's
    grads = [[(torch.randn(s, generator=g) * 10 ** -(i % 3)).to(grad_dtype) for s in shapes] for i in range(3)]
    return master.to(device), [[x.to(device) for x in step] for step in grads]


def _run(master: torch.Tensor, grads_per_step, clip: float | None, impl: str):
    master = master.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    weight16 = torch.zeros(master.shape, dtype=torch.bfloat16, device=master.device)
    step = torch.zeros((), dtype=torch.float32, device=master.device)
    clip_t = None if clip is None else torch.tensor(clip, device=master.device)
    for grads in grads_per_step:
        step += 1
        adamw_master_step(master, exp_avg, exp_avg_sq, weight16, grads, step, HYPER, clip_t, impl=impl)
    return master, exp_avg, exp_avg_sq, weight16


@pytest.mark.parametrize("clip", [None, 4.0])
def test_reference_is_torchs_fused_adamw_on_the_fp32_gradients(clip):
    master, grads = _problem("cpu", torch.bfloat16)
    got, m, v, w16 = _run(master, grads, clip, "reference")
    n = sum(x.numel() for x in grads[0])
    param = torch.nn.Parameter(master[:n].clone())
    opt = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                            weight_decay=HYPER.weight_decay, fused=True)
    for step in grads:
        param.grad = torch.cat([x.reshape(-1).float() for x in step]) / (clip or 1.0)
        opt.step()
    torch.testing.assert_close(got[:n], param.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m[:n], opt.state[param]["exp_avg"], rtol=1e-6, atol=1e-8)  # lerp against b1 m + (1 - b1) g
    torch.testing.assert_close(v[:n], opt.state[param]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    assert torch.equal(w16[:n], got[:n].bfloat16())
    # the padding after the last gradient is left alone
    assert torch.equal(got[n:], master[n:]) and not w16[n:].any() and not m[n:].any()


def test_more_gradients_than_masters_is_refused():
    master, grads = _problem("cpu", torch.bfloat16, pad=0)
    with pytest.raises(ValueError, match="master weights"):
        _run(master[:-1], grads, None, "reference")


def _compare_fused(device: str, grad_dtype: torch.dtype, shapes=SHAPES) -> None:
    master, grads = _problem(device, grad_dtype, shapes=shapes)
    for clip in (None, 4.0):
        want = _run(master, grads, clip, "reference")
        got = _run(master, grads, clip, "fused")
        # one or two roundings apart (fused multiply-adds): masters are ~1, moments ~1e-2 and ~1e-4
        for name, a, b, atol in zip(("master", "exp_avg", "exp_avg_sq"), got[:3], want[:3], (1e-6, 1e-7, 1e-9)):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=atol, msg=name)
        assert (got[3].float() - want[3].float()).abs().max() <= (want[3].float().abs() * 2 ** -7).max()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shapes", [SHAPES, SHAPES_16], ids=["ragged", "multiples-of-16"])
def test_fused_matches_reference(grad_dtype, shapes):
    _compare_fused("cuda", grad_dtype, shapes)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("shapes", [SHAPES, SHAPES_16], ids=["ragged", "multiples-of-16"])
def test_fused_in_the_triton_interpreter(shapes):
    _compare_fused("cpu", torch.bfloat16, shapes)
