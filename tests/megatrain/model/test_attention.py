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
