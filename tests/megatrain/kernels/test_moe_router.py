"""The MoE router's selection (megatrain/kernels/moe_router.py): the reference against a
brute-force definition on CPU; the Triton top-k and counts against the reference on a GPU (and in
Triton's interpreter where ``TRITON_INTERPRET=1`` and Triton are there)."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain.kernels.moe_router import counts_reference, expert_counts, topk_experts, topk_reference

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _scores(n: int, n_experts: int, device: str, skew: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + n + n_experts)
    scores = torch.randn(n, n_experts, generator=g).softmax(-1)
    if skew:  # most tokens prefer the first experts; the bias pulls a few others up
        scores[:, : n_experts // 4] += 1.0
    bias = torch.randn(n_experts, generator=g) * 0.01
    return scores.to(device), bias.to(device)


def test_reference_is_the_brute_force_definition():
    """Each row's k ids, best first: repeatedly the largest score + bias not taken yet; the
    counts are the slots per expert, counted one by one."""
    scores, bias = _scores(20, 6, "cpu")
    k = 3
    experts = topk_reference(scores, bias, k)
    for n in range(20):
        left = {e: (scores[n, e] + bias[e]).item() for e in range(6)}
        for j in range(k):
            best = max(left, key=left.get)
            assert experts[n, j].item() == best
            del left[best]
    counts = counts_reference(experts, 6)
    assert counts.tolist() == [sum(int(e) == x for e in experts.flatten()) for x in range(6)]
    assert counts.dtype == torch.long


def test_on_cpu_auto_is_the_reference():
    scores, bias = _scores(9, 8, "cpu")
    experts = topk_experts(scores, bias, 2)
    assert torch.equal(experts, topk_reference(scores, bias, 2))
    assert torch.equal(expert_counts(experts, 8), counts_reference(experts, 8))


def _compare_fused(device: str, n: int, k: int, n_experts: int, skew: bool, dtype=torch.float32) -> None:
    from megatrain.kernels.moe_router_triton import counts_fused, topk_fused

    scores, bias = _scores(n, n_experts, device, skew)
    scores = scores.to(dtype)
    ours = topk_fused(scores, bias, k)
    ref = topk_reference(scores.float(), bias, k)
    assert ours.dtype == torch.int64 and ours.shape == (n, k)
    assert torch.equal(ours, ref)
    want = counts_reference(ref, n_experts)
    assert torch.equal(counts_fused(ours, n_experts), want) and int(want.sum()) == n * k
    # ties go to the lower id; a NaN ranks first, as in torch.topk; an empty batch is empty
    tied = torch.zeros(3, n_experts, device=device, dtype=dtype)
    tied[1, n_experts - 1] = float("nan")
    got = topk_fused(tied, torch.zeros_like(bias), k)
    assert got[0].tolist() == list(range(k)) and got[1, 0].item() == n_experts - 1
    assert sorted(got[1].tolist()) == sorted(set(got[1].tolist()))  # no expert twice
    assert topk_fused(scores[:0], bias, k).shape == (0, k)
    assert counts_fused(ours[:0], n_experts).tolist() == [0] * n_experts


CASES = [(64, 2, 8, False), (300, 8, 64, True), (1000, 8, 64, False), (17, 6, 160, True), (5, 1, 3, False)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n,k,n_experts,skew", CASES)
def test_fused_matches_reference(n, k, n_experts, skew):
    _compare_fused("cuda", n, k, n_experts, skew)


@pytest.mark.gpu
@requires_cuda
def test_fused_takes_bf16_scores():
    _compare_fused("cuda", 256, 4, 32, False, torch.bfloat16)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,k,n_experts,skew", CASES[:2] + CASES[3:])
def test_fused_in_the_triton_interpreter(n, k, n_experts, skew):
    _compare_fused("cpu", n, k, n_experts, skew)


@pytest.mark.gpu
@requires_cuda
def test_moe_layer_with_the_fused_router_matches_the_reference():
    from megatrain.config.model import ModelConfig
    from megatrain.model.moe import MoE

    base = dict(vocab_size=64, n_layer=1, n_head=2, d_model=64, seq_len=32, mlp="moe", norm="rmsnorm", bias=False,
                moe={"n_experts": 16, "top_k": 4, "expert_d_ff": 32})
    runs = {}
    for impl in ("reference", "fused"):
        torch.manual_seed(0)
        layer = MoE(ModelConfig(**base, kernels={"moe_router": impl, "experts": "padded"}), 0).cuda()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, 32, 64, device="cuda", requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        runs[impl] = (out, x.grad, layer.load, *(p.grad for p in layer.parameters()))
    for ref, fused in zip(runs["reference"], runs["fused"]):
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
