"""The MoE permutation (megatrain/kernels/moe_permute.py): the index-op reference against a
token-by-token loop on CPU; the Triton gathers against the reference, forward and gradients, on
a GPU (and in Triton's interpreter where ``TRITON_INTERPRET=1`` and Triton are there)."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.kernels.moe_permute import (
    Slots,
    group_order,
    permute,
    permute_reference,
    row_of_slot,
    unpermute,
    unpermute_reference,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _routing(n: int, k: int, n_experts: int, d: int, device: str, dtype=torch.float32, skew: bool = False):
    g = torch.Generator().manual_seed(n * 31 + k)
    logits = torch.randn(n, n_experts, generator=g)
    if skew:  # most tokens on the first experts, some experts empty
        logits[:, : n_experts // 4] += 3.0
    experts = logits.topk(k, dim=-1).indices
    order = experts.flatten().argsort(stable=True)
    weights = torch.rand(n, k, generator=g)
    x = torch.randn(n, d, generator=g)
    y = torch.randn(n * k, d, generator=g)
    return (x.to(device, dtype), order.to(device), weights.to(device), y.to(device, dtype))


def test_reference_is_the_token_by_token_definition():
    n, k, d = 13, 3, 5
    x, order, weights, y = _routing(n, k, 6, d, "cpu")
    rows = permute_reference(x, order, k)
    out = unpermute_reference(y, weights, order, k)
    plain = unpermute_reference(y, None, order, k)
    for r, slot in enumerate(order.tolist()):
        assert torch.equal(rows[r], x[slot // k])
    row = {slot: r for r, slot in enumerate(order.tolist())}
    for t in range(n):
        want = sum(weights[t, j] * y[row[t * k + j]] for j in range(k))
        torch.testing.assert_close(out[t], want)
        torch.testing.assert_close(plain[t], sum(y[row[t * k + j]] for j in range(k)))
    assert torch.equal(row_of_slot(order), torch.tensor([row[s] for s in range(n * k)]))


def test_on_cpu_auto_is_the_reference():
    x, order, weights, y = _routing(7, 2, 4, 3, "cpu")
    slots = Slots(order, row_of_slot(order), 2)
    assert torch.equal(permute(x, slots), permute_reference(x, order, 2))
    assert torch.equal(unpermute(y, weights, slots), unpermute_reference(y, weights, order, 2))
    assert torch.equal(unpermute(y, None, slots), unpermute_reference(y, None, order, 2))


def _compare_fused(device: str, n: int, k: int, n_experts: int, d: int, dtype, skew: bool) -> None:
    """Forward and gradients of the Triton kernels against the reference, the combine weighted and
    plain: in fp32 to 1e-5. In bf16, against the exact values (the reference in fp64 on the same
    inputs): each output is that value rounded once (its sums run in fp32), where the reference
    rounds the weights and each product. On CUDA the outputs are likely poisoned: the caching
    allocator hands out the freed NaN block next, so a row the kernels never wrote fails."""
    from megatrain.kernels.moe_permute_triton import combine_fused, dispatch_fused

    x, order, weights, y = _routing(n, k, n_experts, d, device, dtype, skew)
    inverse = row_of_slot(order)
    reference = (lambda x: permute_reference(x, order, k),
                 lambda y, w, r=None: unpermute_reference(y, w, order, k) + (0 if r is None else r))
    fused = (lambda x: dispatch_fused(x, inverse, k), lambda y, w, r=None: combine_fused(y, w, inverse, k, r))

    def run(impl, cast=None):
        leaf = lambda t: t.detach().to(cast or t.dtype).clone().requires_grad_()  # noqa: E731
        xs = leaf(x)
        combines = {  # name: (y, weights or None, residual or None), the residual added in the same pass
            "weighted": (leaf(y), leaf(weights), None), "plain": (leaf(y), None, None),
            "weighted+residual": (leaf(y), leaf(weights), leaf(x)), "plain+residual": (leaf(y), None, leaf(x))}
        torch.full((4 * n * k * d,), float("nan"), device=device)  # freed at once: the next blocks hold NaN
        got = {"rows": impl[0](xs), **{name: impl[1](*args) for name, args in combines.items()}}
        g = torch.Generator().manual_seed(1)
        for output in got.values():  # upstream gradients that the dtype holds exactly
            output.backward(torch.randn(output.shape, generator=g).to(dtype).to(device, output.dtype))
        got["dx"] = xs.grad
        for name, args in combines.items():
            got.update({f"{name} d{part}": t.grad for part, t in zip(("y", "w", "residual"), args) if t is not None})
        return got

    ours, ref = run(fused), run(reference)
    truth = run(reference, torch.float64) if dtype != torch.float32 else None
    for what in ours:
        assert ours[what].dtype == ref[what].dtype and ours[what].shape == ref[what].shape, what
        if truth is None:
            torch.testing.assert_close(ours[what], ref[what], rtol=1e-5, atol=1e-5, msg=what)
        else:
            exact = truth[what]
            bound = 2.0 ** -8 * exact.abs() + 1e-4 * exact.abs().max()  # half a bf16 step, and fp32 sums
            worst = ((ours[what].double() - exact).abs() - bound).max().item()
            assert worst <= 0, f"{what}: off the exactly rounded value by {worst:.3g} beyond half a bf16 step"


CASES = [(64, 2, 8, 32, False), (300, 8, 64, 96, True), (17, 1, 4, 1000, False)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,n_experts,d,skew", CASES)
def test_fused_matches_reference_forward_and_gradients(n, k, n_experts, d, skew, dtype):
    _compare_fused("cuda", n, k, n_experts, d, dtype, skew)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,k,n_experts,d,skew", CASES[:2])
def test_fused_in_the_triton_interpreter(n, k, n_experts, d, skew):
    _compare_fused("cpu", n, k, n_experts, d, torch.float32, skew)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n_shared", [0, 1])  # without a shared expert the combine adds the residual itself
def test_moe_layer_with_the_fused_permutation_matches_the_reference(n_shared):
    from megatrain.config.model import ModelConfig
    from megatrain.model.moe import MoE

    base = dict(vocab_size=64, n_layer=1, n_head=2, d_model=64, seq_len=32, mlp="moe", norm="rmsnorm", bias=False,
                moe={"n_experts": 8, "top_k": 2, "expert_d_ff": 32, "n_shared_experts": n_shared})
    grads = {}
    for impl in ("reference", "fused"):
        torch.manual_seed(0)
        cfg = ModelConfig(**base, kernels={"moe_permute": impl, "experts": "padded"})
        layer = MoE(cfg, 0).cuda()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, 32, 64, device="cuda", requires_grad=True)
        residual = torch.randn(2, 32, 64, device="cuda", requires_grad=True)
        out = layer(x, residual=residual)
        out.square().sum().backward()
        grads[impl] = (out, x.grad, residual.grad, *(p.grad for p in layer.parameters()))
    for ref, fused in zip(grads["reference"], grads["fused"]):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_groups", [8, 256, 257, 40000])
def test_group_order_is_the_stable_argsort_of_the_wide_ids(n_groups):
    """The narrowed keys (uint8 up to 256 groups, then int16, then int32) sort exactly as the int64
    ids: the same stable order, ties kept in slot order."""
    ids = torch.randint(0, n_groups, (5000,), generator=torch.Generator().manual_seed(n_groups))
    ids[:10] = n_groups - 1  # the largest id is where a too-narrow key would wrap
    assert torch.equal(group_order(ids, n_groups), ids.argsort(stable=True))
