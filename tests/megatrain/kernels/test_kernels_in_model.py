"""The fused kernels inside the real model, on GPU: a small GPT under bf16 autocast gives the same
loss and gradients with every kernel fused (and flex sliding-window attention) as with the
references. Tolerance: loss within 1e-2 relative; all gradients together within 3e-2 relative
(bf16 rounding differs: the fused LayerNorm and GeLU keep bf16 activations where the references
promote to fp32)."""

import pytest
import torch

from megatrain.config.model import KernelConfig, ModelConfig
from megatrain.model.gpt import GPT

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _loss_and_grads(cfg: ModelConfig, state: dict, idx: torch.Tensor, targets: torch.Tensor):
    model = GPT(cfg).cuda()
    model.load_state_dict(state)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, targets)
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    return loss.detach(), grads


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block, attention", [("parallel", "full"), ("serial", "sliding")])
def test_fused_model_matches_reference_model(block, attention):
    base = dict(vocab_size=1024, n_layer=2, n_head=4, d_model=256, seq_len=512, block=block, attention=attention,
                window=128 if attention == "sliding" else None)
    ref_cfg = ModelConfig(**base, kernels=KernelConfig(layernorm="reference", gelu="reference",
                                                       cross_entropy="reference", attention="reference"))
    fused_cfg = ModelConfig(**base, kernels=KernelConfig(layernorm="fused", gelu="fused", cross_entropy="fused",
                                                         attention="auto"))
    torch.manual_seed(0)
    state = GPT(ref_cfg).state_dict()
    idx = torch.randint(0, 1024, (4, 512), device="cuda")
    targets = torch.randint(0, 1024, (4, 512), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(ref_cfg, state, idx, targets)
    loss, grads = _loss_and_grads(fused_cfg, state, idx, targets)
    assert torch.isfinite(loss) and torch.isfinite(grads).all()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert ((grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2


@pytest.mark.gpu
@requires_cuda
def test_compiled_blocks_with_auto_kernels_match_reference_model():
    """The default GPU path: blocks under torch.compile with ``auto`` kernels (the Triton bias +
    GeLU runs inside the compiled graph, LayerNorm is left to inductor) against the eager
    reference model."""
    base = dict(vocab_size=1024, n_layer=2, n_head=4, d_model=256, seq_len=512, block="parallel")
    ref_cfg = ModelConfig(**base, kernels=KernelConfig(layernorm="reference", gelu="reference",
                                                       cross_entropy="reference", attention="reference"))
    torch.manual_seed(0)
    state = GPT(ref_cfg).state_dict()
    idx = torch.randint(0, 1024, (4, 512), device="cuda")
    targets = torch.randint(0, 1024, (4, 512), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(ref_cfg, state, idx, targets)

    model = GPT(ModelConfig(**base)).cuda()
    model.load_state_dict(state)
    for block in model.blocks:
        block.compile(fullgraph=True)  # a graph break inside the block would fail here
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, targets)
    loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    assert torch.isfinite(loss) and torch.isfinite(grads).all()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert ((grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2
