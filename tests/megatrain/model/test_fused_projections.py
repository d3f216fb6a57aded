"""The parallel block's fused projections (two matmuls instead of four) compute the same
function, with the same gradients, as the four separate projections; the kernels' ``auto``
choice falls back to the reference ops inside torch.compile."""

import pytest
import torch
import torch.nn as nn

import megatrain.model.block as block_module
from megatrain.config import ModelConfig
from megatrain.kernels import resolve
from megatrain.model import GPT
from megatrain.model.block import ParallelBlock

SMALL = dict(vocab_size=256, n_layer=2, n_head=4, d_model=32, seq_len=16, block="parallel")


@pytest.fixture
def fuse(monkeypatch):
    def set_mode(mode: str) -> None:
        monkeypatch.setattr(block_module, "FUSE_PROJECTIONS", mode)
    return set_mode


def _loss_and_grads(model: GPT, idx: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("attention, window", [("full", None), ("sliding", 4)])
def test_fused_projections_match_the_four_projections(fuse, bias, attention, window):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SMALL, bias=bias, attention=attention, window=window)).double()
    with torch.no_grad():  # non-zero biases, so a bias that went to the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    idx = torch.randint(0, 256, (2, 16))
    fuse("never")
    ref_loss, ref_grads = _loss_and_grads(model, idx)
    fuse("always")
    assert all(b._fuse_projections() for b in model.blocks)
    loss, grads = _loss_and_grads(model, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_block_with_replaced_regions_or_linears_is_not_fused(fuse):
    fuse("always")
    cfg = ModelConfig(**SMALL)
    block = ParallelBlock(cfg)
    assert block._fuse_projections()
    block.exit = nn.Sequential()  # tensor parallelism fills the regions with its own modules
    assert not block._fuse_projections()

    class NotALinear(nn.Module):
        def __init__(self, inner: nn.Linear):
            super().__init__()
            self.weight, self.bias, self.out_features = inner.weight, inner.bias, inner.out_features

        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.bias)

    block = ParallelBlock(cfg)
    block.attn.qkv = NotALinear(block.attn.qkv)
    assert not block._fuse_projections()


def test_fusion_is_off_by_default():
    assert block_module.FUSE_PROJECTIONS == "never"  # measured slower on an H200 (benchmarks/mfu.py)
    assert not ParallelBlock(ModelConfig(**SMALL))._fuse_projections()


def test_compile_mode_fuses_only_compiled_blocks(fuse):
    fuse("compile")
    block = ParallelBlock(ModelConfig(**SMALL))
    assert not block._fuse_projections()
    seen = []

    def probe(x):
        seen.append(block._fuse_projections())
        return x + 1

    torch.compile(probe, backend="eager")(torch.zeros(2))
    assert seen == [True]
    fuse("never")
    block = ParallelBlock(ModelConfig(**SMALL))
    torch.compile(lambda x: (seen.append(block._fuse_projections()), x + 1)[1], backend="eager")(torch.zeros(3))
    assert seen == [True, False]


def test_auto_kernels_resolve_to_the_reference_under_compile():
    x = torch.zeros(2)
    seen = []

    def probe(x):
        seen.append((resolve("auto", x), resolve("auto", x, under_compile="fused"), resolve("auto", x, under_compile=None)))
        return x + 1

    probe(x)
    torch.compile(probe, backend="eager")(x)
    # eager on CPU: reference everywhere; compiled: what under_compile says (None: as eager)
    assert seen == [("reference",) * 3, ("reference", "fused", "reference")]
    assert resolve("fused", x) == "fused" and resolve("reference", x, under_compile="fused") == "reference"
