import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.model import GPT, count_parameters, expected_parameter_count
from megatrain.model.block import ParallelBlock, SerialBlock

SMALL = dict(vocab_size=256, n_layer=3, n_head=4, d_model=32, seq_len=16)


@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("bias, tied", [(True, True), (False, False)])
def test_parameter_count_matches_formula(block, bias, tied):
    cfg = ModelConfig(**SMALL, block=block, bias=bias, tie_embeddings=tied)
    assert count_parameters(GPT(cfg)) == expected_parameter_count(cfg)


def test_parallel_block_has_one_layernorm_less_per_layer():
    par = ModelConfig(**SMALL, block="parallel")
    ser = ModelConfig(**SMALL, block="serial")
    assert expected_parameter_count(ser) - expected_parameter_count(par) == SMALL["n_layer"] * 2 * SMALL["d_model"]


def test_gpt_1_3b_is_1_3b():
    cfg = ModelConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=2048)
    assert 1.2e9 < expected_parameter_count(cfg) < 1.45e9


def test_layers_are_a_flat_ordered_list_that_reproduces_forward():
    cfg = ModelConfig(**SMALL)
    model = GPT(cfg)
    layers = model.layers()
    assert len(layers) == cfg.n_layer + 2
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx))


def test_parallel_block_is_x_plus_attn_plus_mlp_of_one_norm():
    cfg = ModelConfig(**SMALL, block="parallel")
    block = ParallelBlock(cfg)
    x = torch.randn(2, 16, 32)
    h = block.ln(x)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.mlp(h))


def test_serial_block_is_pre_ln():
    cfg = ModelConfig(**SMALL, block="serial")
    block = SerialBlock(cfg)
    x = torch.randn(2, 16, 32)
    y = x + block.attn(block.ln1(x))
    torch.testing.assert_close(block(x), y + block.mlp(block.ln2(y)))


def test_loss_is_cross_entropy_of_logits_and_causal():
    cfg = ModelConfig(**SMALL, attention="sliding", window=4)
    model = GPT(cfg)
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    torch.testing.assert_close(model(idx, idx), torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()))
    # changing a future token never changes an earlier position's logits
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])


def test_init_is_seeded_and_scaled():
    cfg = ModelConfig(**SMALL)
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(0)
    b = GPT(cfg)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    proj_std = a.blocks[0].attn.proj.weight.std().item()
    assert proj_std == pytest.approx(cfg.init_std / (2 * cfg.n_layer) ** 0.5, rel=0.2)
    assert torch.all(a.blocks[0].attn.qkv.bias == 0)
