import pytest
import torch

from megatrain.kernels.attention import attention_reference, attention_sdpa, causal_attention, sliding_window_mask


def brute_force_mask(T, window):
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            mask[i, j] = j <= i and (window is None or i - j < window)
    return mask


@pytest.mark.parametrize("T, window", [(1, 1), (7, 1), (16, 3), (16, 16), (33, 8), (20, None)])
def test_sliding_window_mask_equals_brute_force(T, window):
    assert torch.equal(sliding_window_mask(T, window), brute_force_mask(T, window))


def _qkv(B=2, H=3, T=24, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("window", [1, 5, 23])
def test_window_attends_exactly_to_the_last_w_tokens(window):
    q, k, v = _qkv()
    out = attention_reference(q, k, v, window)
    # brute force, one query at a time
    T = q.shape[2]
    for i in range(T):
        lo = max(0, i - window + 1)
        scores = (q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-2, -1)) / q.shape[-1] ** 0.5
        expected = torch.softmax(scores, -1) @ v[:, :, lo : i + 1]
        torch.testing.assert_close(out[:, :, i : i + 1], expected)


@pytest.mark.parametrize("window", [24, 25, 1000])
def test_window_at_least_seq_len_equals_full_attention(window):
    q, k, v = _qkv()
    torch.testing.assert_close(attention_reference(q, k, v, window), attention_reference(q, k, v, None))
    torch.testing.assert_close(attention_sdpa(q, k, v, window), attention_sdpa(q, k, v, None))


@pytest.mark.parametrize("window", [None, 4, 24])
def test_sdpa_matches_reference(window):
    q, k, v = _qkv()
    torch.testing.assert_close(causal_attention(q, k, v, window, "sdpa"), causal_attention(q, k, v, window, "reference"))


def test_token_major_keeps_the_values_in_a_transposed_tokens_first_layout():
    from megatrain.model.attention import token_major

    x = torch.randn(2, 3, 5, 4)  # [B, H, T, hd]
    y = token_major(x)
    assert torch.equal(y, x) and y.shape == x.shape
    assert y.transpose(1, 2).is_contiguous()  # stored [B, T, H, hd]


def _compiled_against_eager(monkeypatch, token_major: bool, device: str, dtype: torch.dtype, tol: float) -> None:
    import megatrain.model.attention as attention
    from megatrain.config.model import ModelConfig

    monkeypatch.setattr(attention, "ROPE_TOKEN_MAJOR", token_major)
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=256, seq_len=128, position="rope",
                      norm="rmsnorm", mlp="swiglu", bias=False)
    torch.manual_seed(0)
    layer = attention.Attention(cfg).to(device, dtype)
    x = torch.randn(2, 128, 256, device=device, dtype=dtype, requires_grad=True)
    eager = layer(x)
    (dx_eager,) = torch.autograd.grad(eager.float().square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(layer)(x)
    (dx,) = torch.autograd.grad(compiled.float().square().sum(), x)
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, dx_eager, rtol=tol, atol=tol * dx_eager.abs().max().item())


@pytest.mark.parametrize("token_major", [True, False])
def test_compiled_rope_attention_matches_eager_in_either_layout(monkeypatch, token_major):
    """model/attention.py: inside torch.compile the rotated q and k may be stored tokens-first
    (ROPE_TOKEN_MAJOR); the output and the gradients are those of eager mode either way."""
    _compiled_against_eager(monkeypatch, token_major, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("token_major", [True, False])
def test_compiled_rope_attention_matches_eager_on_the_gpu(monkeypatch, token_major):
    """The same in bf16 through SDPA's GPU kernels, which give their output q's memory layout."""
    _compiled_against_eager(monkeypatch, token_major, "cuda", torch.bfloat16, 2e-2)
