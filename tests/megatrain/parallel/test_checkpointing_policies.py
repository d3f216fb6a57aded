"""Activation checkpointing policies: every policy gives none's loss and gradients (fp32, CPU), and
the attention core / blocks are really run again in the backward."""

import copy

import pytest
import torch

import megatrain.model.attention as attention_module
from megatrain.config import ModelConfig
from megatrain.config.model import CheckpointingPolicy
from megatrain.model import GPT
from megatrain.parallel.parallelize import apply_activation_checkpointing

CFG = dict(vocab_size=64, n_layer=4, n_head=4, n_kv_head=2, d_model=32, d_ff=64, seq_len=16, position="rope",
           norm="rmsnorm", mlp="swiglu", bias=False, block="serial", attention="full")
# policy -> attention cores run in forward + backward, MLP forwards (4 layers): full runs every
# block's MLP again, every_n (n = 2) blocks 0 and 2's, selective none.
EXPECTED = {"none": (4, 4), "full": (8, 8), "selective": (8, 4), "every_n": (6, 6)}


def test_true_false_and_names_read_as_policies():
    assert ModelConfig(activation_checkpointing=True).activation_checkpointing.policy == "full"
    assert ModelConfig(activation_checkpointing=False).activation_checkpointing.policy == "none"
    assert ModelConfig(activation_checkpointing="selective").activation_checkpointing.policy == "selective"
    every = ModelConfig(activation_checkpointing={"policy": "every_n", "n": 2}).activation_checkpointing
    assert [every.recomputed(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize("policy", EXPECTED)
def test_policy_keeps_loss_and_gradients_and_recomputes(policy, monkeypatch):
    torch.manual_seed(0)
    reference = GPT(ModelConfig(**CFG))
    model = copy.deepcopy(reference)
    spec = {"policy": policy, "n": 2} if policy == "every_n" else policy
    apply_activation_checkpointing(model, CheckpointingPolicy.model_validate(spec))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))

    ref_loss = reference(idx, targets)
    ref_loss.backward()
    calls = {"attention": 0, "mlp": 0}
    real = attention_module.causal_attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(attention_module, "causal_attention", counted)
    # counted on the MLP's first projection: torch's non-reentrant checkpoint stops a block's
    # recompute once its last saved tensor is back, inside the MLP, before the MLP's own forward returns
    hooks = [m.mlp.fc.register_forward_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
             for m in (b.block if hasattr(b, "block") else b for b in model.blocks)]
    loss = model(idx, targets)
    loss.backward()
    for h in hooks:
        h.remove()
    assert torch.equal(loss, ref_loss)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        plain = name.replace(".block.", ".", 1)
        torch.testing.assert_close(p.grad, grads[plain].grad, rtol=0, atol=1e-6, msg=name)
    attention, mlp = EXPECTED[policy]
    assert calls["attention"] == attention
    assert calls["mlp"] == mlp  # selective: the MLP is not run again; full and every_n: it is
