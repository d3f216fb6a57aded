"""kernels/moe_gemm.py: the tiling of the experts' row segments and the references (on CPU); the
fused gather + grouped GEMM + SwiGLU and the gathered weight gradient held to their references on
a GPU (and in Triton's interpreter where ``TRITON_INTERPRET=1`` and Triton are there)."""

import os

import pytest
import torch

from megatrain.kernels.moe_gemm import gathered_swiglu_mm_reference, gathered_wgrad_reference, segment_tiles


def test_segment_tiles_cover_every_row_of_every_expert_once():
    counts = torch.tensor([5, 0, 33, 16, 1])
    expert, first_row = segment_tiles(counts, int(counts.sum()), block_m=16)
    assert expert.numel() == -(-55 // 16) + 5  # the fixed grid: enough for any split of 55 rows
    covered = []
    start = 0
    want = []
    for e, n in enumerate(counts.tolist()):
        want += [(e, start + i) for i in range(0, n, 16)]
        start += n
    got = [(int(e), int(r)) for e, r in zip(expert, first_row) if e < len(counts)]
    assert got == want  # tiles in expert order, each starting at its rows
    for e, r in got:
        covered += list(range(r, min(r + 16, int(torch.cumsum(counts, 0)[e]))))
    assert covered == list(range(55))
    assert all(int(e) == len(counts) for e in expert[len(want):])  # the spare tiles are skipped


def test_the_reference_is_the_gathered_grouped_gemm_then_swiglu():
    torch.manual_seed(0)
    x, fc = torch.randn(6, 8), torch.randn(3, 2 * 4, 8)
    row_src, counts = torch.tensor([0, 5, 2, 2, 1, 4, 3]), torch.tensor([2, 0, 5])
    act, h = gathered_swiglu_mm_reference(x, row_src, counts, fc)
    experts = [0, 0, 2, 2, 2, 2, 2]
    for r, (src, e) in enumerate(zip(row_src.tolist(), experts)):
        row = x[src] @ fc[e].T
        assert torch.allclose(h[r], row, atol=1e-5)
        assert torch.allclose(act[r], torch.nn.functional.silu(row[:4]) * row[4:], atol=1e-5)


def test_the_weight_gradient_reference_is_autograds_gradient_of_the_forward():
    """The gradient the forward's reference gets from autograd, for fc, is what the gathered weight
    gradient computes from h's gradient."""
    torch.manual_seed(1)
    x, fc = torch.randn(6, 8), torch.randn(3, 2 * 4, 8, requires_grad=True)
    row_src, counts = torch.tensor([0, 5, 2, 2, 1, 4, 3]), torch.tensor([2, 0, 5])
    rows, h = x[row_src], []
    start = 0
    for e, n in enumerate(counts.tolist()):
        h.append(rows[start:start + n] @ fc[e].T)
        start += n
    h = torch.cat(h)
    dh = torch.randn_like(h)
    h.backward(dh)
    assert torch.allclose(gathered_wgrad_reference(x, row_src, counts, dh), fc.grad, atol=1e-5)


def _wgrad_compare(device: str, dtype: torch.dtype, n_tokens: int, k: int, n_experts: int, d: int, ff: int, **blocks):
    from megatrain.kernels.moe_gemm import gathered_wgrad

    g = torch.Generator().manual_seed(n_experts + 1)
    x = torch.randn(n_tokens, d, generator=g).to(device, dtype)
    choice = torch.randint(0, n_experts, (n_tokens * k,), generator=g)
    choice[choice == 1] = 0  # expert 1 gets no row: its gradient is zero
    order = choice.argsort(stable=True)
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    row_src = (order // k).to(device)
    dh = torch.randn(n_tokens * k, 2 * ff, generator=g).to(device, dtype)
    got = gathered_wgrad(x, row_src, counts, dh, **blocks)
    want = gathered_wgrad_reference(x, row_src, counts, dh)
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.5, rtol=2e-2)  # sums of ~1000 rows
    assert torch.allclose(got.float(), want.float(), **tol)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def _compare(device: str, dtype: torch.dtype, n_tokens: int, k: int, n_experts: int, d: int, ff: int, **blocks):
    from megatrain.kernels.moe_gemm import gathered_swiglu_mm

    g = torch.Generator().manual_seed(n_experts)
    x = torch.randn(n_tokens, d, generator=g).to(device, dtype)
    fc = (torch.randn(n_experts, 2 * ff, d, generator=g) / d**0.5).to(device, dtype)
    choice = torch.randint(0, n_experts, (n_tokens * k,), generator=g)
    choice[choice == 1] = 0  # expert 1 gets no row
    order = choice.argsort(stable=True)
    counts = torch.bincount(choice, minlength=n_experts).to(device)
    row_src = (order // k).to(device)
    act, h = gathered_swiglu_mm(x, row_src, counts, fc, **blocks)
    want_act, want_h = gathered_swiglu_mm_reference(x, row_src, counts, fc)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert torch.allclose(h.float(), want_h.float(), **tol)
    assert torch.allclose(act.float(), want_act.float(), **tol)


@pytest.mark.gpu  # with the GPU tests: it needs Triton, which CPU machines lack
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter: TRITON_INTERPRET=1")
def test_fused_matches_the_reference_in_the_interpreter():
    # fp32 only: the interpreter truncates on its bf16 casts where torch rounds
    _compare("cpu", torch.float32, n_tokens=40, k=2, n_experts=4, d=48, ff=40, block_m=16, block_n=16, block_k=16)
    _wgrad_compare("cpu", torch.float32, n_tokens=40, k=2, n_experts=4, d=48, ff=40, block_n=16, block_k=16,
                   block_r=16)
    # widths the tiles divide: the kernels' unmasked main loops
    _compare("cpu", torch.float32, n_tokens=24, k=2, n_experts=3, d=32, ff=16, block_m=16, block_n=16, block_k=16)
    _wgrad_compare("cpu", torch.float32, n_tokens=24, k=2, n_experts=3, d=32, ff=16, block_n=16, block_k=16,
                   block_r=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_the_reference_on_the_gpu(dtype):
    _compare("cuda", dtype, n_tokens=1000, k=8, n_experts=64, d=1024, ff=640)
    _wgrad_compare("cuda", dtype, n_tokens=1000, k=8, n_experts=64, d=1024, ff=640)
