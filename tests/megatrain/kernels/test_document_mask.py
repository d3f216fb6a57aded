"""The document mask (model.attention_mask: document) against references built another way.

- ``document_ids``: the token after an EOS starts a new document.
- The reference and SDPA with ``doc_ids`` equal plain causal attention run on each document alone
  (and with a window), on CPU in fp64; eager FlexAttention's block mask equals them on CPU.
- The model: a packed sample under the document mask gives each document the logits it gets when
  run alone at the same positions (positions are not reset per document, Llama 3's choice).
- On CUDA (``gpu``): compiled FlexAttention with the document block mask, forward and backward,
  against the fp64 reference, bf16 within 2x (+1e-3) of the bf16 reference's own error.
"""

import pytest
import torch

from megatrain.kernels.attention import attention_reference, attention_sdpa, causal_attention, document_ids

EOS = 0


def _tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (B, T), generator=g)
    tokens[torch.rand(B, T, generator=g) < 0.08] = EOS
    return tokens


def _per_document(q, k, v, tokens, window):
    """Each document's causal attention computed alone, written back in place: [B, H, T, hd]."""
    out = torch.empty_like(q)
    ids = document_ids(tokens, EOS)
    for b in range(q.shape[0]):
        for d in ids[b].unique():
            idx = (ids[b] == d).nonzero().flatten()
            s = slice(int(idx[0]), int(idx[-1]) + 1)
            out[b:b + 1, :, s] = attention_reference(q[b:b + 1, :, s], k[b:b + 1, :, s], v[b:b + 1, :, s], window)
    return out


def test_document_ids_start_after_each_eos():
    tokens = torch.tensor([[7, 0, 3, 4, 0, 0, 9], [0, 1, 2, 3, 4, 5, 0]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("window", [None, 5])
def test_reference_and_sdpa_equal_each_document_alone(window):
    B, H, G, T, hd = 2, 4, 2, 64, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    tokens = _tokens(B, T)
    ids = document_ids(tokens, EOS)
    assert ids.max() >= 3  # several documents per sample
    want = _per_document(q, k, v, tokens, window)
    torch.testing.assert_close(attention_reference(q, k, v, window, doc_ids=ids), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attention_sdpa(q, k, v, window, ids), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(causal_attention(q, k, v, window, "auto", ids), want, rtol=1e-10, atol=1e-10)
    # the mask matters: plain causal attention differs
    assert (attention_reference(q, k, v, window) - want).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 40])
def test_flex_document_block_mask_on_cpu(window):
    from megatrain.kernels.flex_attention import attention_flex

    B, H, T, hd = 2, 2, 256, 16
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
    ids = document_ids(_tokens(B, T, seed=3), EOS)
    torch.testing.assert_close(attention_flex(q, k, v, window, ids), attention_reference(q, k, v, window, doc_ids=ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_model_gives_each_document_its_own_logits(position):
    from megatrain.config import ModelConfig
    from megatrain.model import GPT
    from megatrain.model.sequence import Sequence

    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=32, position=position,
                      attention_mask="document", dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    model.eos_id = EOS
    tokens = _tokens(1, 32, seed=4)
    packed = model(tokens)  # [1, T, V]
    ids = document_ids(tokens, EOS)[0]
    assert ids.max() >= 2
    for d in ids.unique():
        idx = (ids == d).nonzero().flatten()
        causal = Sequence(positions=idx)  # the document alone, at its place in the sample, no document ids
        got = model(tokens[:, idx], sequence=causal)
        torch.testing.assert_close(packed[:, idx], got, rtol=1e-10, atol=1e-10)


def test_model_refuses_a_document_mask_without_eos():
    from megatrain.config import ModelConfig
    from megatrain.model import GPT

    model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, seq_len=8, attention_mask="document"))
    with pytest.raises(ValueError, match="model.attention_mask=document"):
        model(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T, window", [(256, None), (1024, None), (1024, 200)])
def test_flex_document_mask_matches_reference_on_cuda(T, window):
    g = torch.Generator("cuda").manual_seed(T)
    q, k, v = (torch.randn(2, 4, T, 64, generator=g, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    tokens = torch.randint(1, 50, (2, T), generator=g, device="cuda")
    tokens[torch.rand(2, T, generator=g, device="cuda") < 0.01] = EOS
    ids = document_ids(tokens, EOS)

    def run(fn, q, k, v, dout):
        out = fn(q, k, v)
        return [out, *torch.autograd.grad(out, [q, k, v], dout)]

    flex = run(lambda q, k, v: causal_attention(q, k, v, window, "auto", ids), q, k, v, dout)
    ref = run(lambda q, k, v: attention_reference(q, k, v, window, doc_ids=ids), q, k, v, dout)
    exact = run(lambda q, k, v: attention_reference(q, k, v, window, doc_ids=ids),
                *[x.detach().double().requires_grad_() for x in (q, k, v)], dout.double())
    for name, got, r, e in zip(["out", "dq", "dk", "dv"], flex, ref, exact):
        assert torch.isfinite(got).all(), name
        err = ((got.double() - e).norm() / e.norm()).item()
        ref_err = ((r.double() - e).norm() / e.norm()).item()
        assert err <= 2 * ref_err + 1e-3, f"{name}: flex error {err:.2e}, reference's own {ref_err:.2e}"
