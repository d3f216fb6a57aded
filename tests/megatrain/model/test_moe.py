"""model.mlp=moe (megatrain/model/moe.py, moe_experts.py): each fast path against its plain
reference, the router against brute force, the load-balancing penalties' gradients against the
penalties written into the loss, the aux-free bias, and activation checkpointing."""

import pytest
import torch
from pydantic import ValidationError

from megatrain.config.model import ModelConfig, MoEConfig
from megatrain.model import (
    GPT,
    active_parameter_count,
    count_parameters,
    expected_parameter_count,
)
from megatrain.model.moe import MoE, Router, end_step, set_aux_loss_scale
from megatrain.model.moe_experts import (
    experts_grouped,
    experts_padded,
    experts_reference,
)
from megatrain.parallel.parallelize import apply_activation_checkpointing


def tiny(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, d_model=64, seq_len=32, position="rope",
                       norm="rmsnorm", mlp="moe", bias=False, block="serial", d_ff=96,
                       moe=MoEConfig(**{"n_experts": 4, "top_k": 2, "expert_d_ff": 32, **moe}))


def expert_inputs(counts: list[int], d: int = 16, ff: int = 24, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), d, generator=g).to(device, dtype).requires_grad_()
    fc = (0.2 * torch.randn(len(counts), 2 * ff, d, generator=g)).to(device, dtype).requires_grad_()
    proj = (0.2 * torch.randn(len(counts), d, ff, generator=g)).to(device, dtype).requires_grad_()
    upstream = torch.randn(sum(counts), d, generator=g).to(device, dtype)
    return x, torch.tensor(counts, device=device), fc, proj, upstream


def run_path(path, x, counts, fc, proj, upstream, scale=None):
    for t in (x, fc, proj, scale):
        if t is not None:
            t.grad = None
    y = path(x, counts, fc, proj, scale=scale)
    y.backward(upstream)
    grads = (x.grad.clone(), fc.grad.clone(), proj.grad.clone()) + ((scale.grad.clone(),) if scale is not None else ())
    return (y.detach(), *grads)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("path", [experts_padded, experts_grouped])
def test_expert_paths_match_the_loop_forward_and_backward(path, scaled):
    """Uneven segments, one expert with no token at all; with a row scale (the router's weights)
    and its gradient too."""
    inputs = expert_inputs([5, 0, 11, 3])
    scale = torch.rand(19, generator=torch.Generator().manual_seed(3)).requires_grad_() if scaled else None
    want = run_path(experts_reference, *inputs, scale=scale)
    got = run_path(path, *inputs, scale=scale)
    for name, a, b in zip(("out", "dx", "dfc", "dproj", "dscale"), got, want):
        assert (a - b).abs().max() < 1e-5, (path.__name__, name, (a - b).abs().max())
    assert want[2][1].abs().max() == 0  # the idle expert gets no gradient
    if scaled:  # the scale is each row's factor: the unscaled rows times it
        plain = run_path(experts_reference, *inputs)[0]
        torch.testing.assert_close(want[0], plain * scale.detach()[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("path", [experts_padded, experts_grouped])
def test_expert_paths_match_the_loop_on_cuda_in_bf16(path, scaled):
    """Hopper shapes in bf16 (torch._grouped_mm's fast case): against the fp32 loop."""
    inputs = expert_inputs([700, 0, 1100, 248, 33, 1, 512, 1], d=256, ff=512, dtype=torch.bfloat16, device="cuda")
    ref32 = [t.detach().float().requires_grad_() if t.is_floating_point() else t for t in inputs]
    scale = torch.rand(2595, device="cuda") if scaled else None
    want = run_path(experts_reference, *ref32, scale=scale.clone().requires_grad_() if scaled else None)
    got = run_path(path, *inputs, scale=scale.clone().requires_grad_() if scaled else None)
    for name, a, b in zip(("out", "dx", "dfc", "dproj", "dscale"), got, want):
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < 2e-2, (path.__name__, name, err)


@pytest.mark.parametrize("score, norm, bias", [("softmax", True, False), ("softmax", False, True), ("sigmoid", True, True)])
def test_top_k_routing_matches_brute_force(score, norm, bias):
    cfg = tiny(router_score=score, norm_topk_prob=norm, n_experts=6, top_k=3)
    router = Router(cfg)
    if bias:  # the aux-free bias steers the choice, never the weights
        router.bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.25]))
    x = torch.randn(40, cfg.d_model)
    r = router(x)
    for n in range(x.shape[0]):
        logits = [float(v) for v in x[n] @ router.gate.weight.detach().t()]
        scores = torch.tensor(logits).softmax(-1) if score == "softmax" else torch.tensor(logits).sigmoid()
        ranked = sorted(range(6), key=lambda e: -(float(scores[e]) + float(router.bias[e])))[:3]
        assert r.experts[n].tolist() == ranked
        chosen = scores[ranked]
        want = chosen / chosen.sum() if norm else chosen
        torch.testing.assert_close(r.weights[n], want, rtol=1e-5, atol=1e-6)


def test_moe_layer_is_the_per_token_sum_of_its_experts():
    """dispatch -> experts -> combine (+ shared) against one token at a time, by definition."""
    cfg = tiny(n_shared_experts=1, n_experts=5, top_k=2)
    torch.manual_seed(0)
    layer = MoE(cfg, layer=0).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 7, cfg.d_model)
    y = layer(x).view(-1, cfg.d_model)
    r = layer.router(x.view(-1, cfg.d_model))
    fc, proj = layer.experts.fc, layer.experts.proj
    for n, token in enumerate(x.view(-1, cfg.d_model)):
        want = layer.shared(token)
        for e, w in zip(r.experts[n].tolist(), r.weights[n]):
            gate, up = (fc[e] @ token).chunk(2)
            want = want + w * (proj[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(y[n], want, rtol=1e-5, atol=1e-6)


def test_weights_in_the_experts_equal_the_weighted_combine(monkeypatch):
    """The router's weights scale the experts' hidden rows (local experts) or their outputs in the
    combine (expert parallelism's path): the same layer, output and every gradient."""
    import megatrain.model.moe as moe

    cfg = tiny(n_shared_experts=1, n_experts=5, top_k=2, aux_loss_coef=0.1)
    torch.manual_seed(0)
    layer = MoE(cfg, layer=0).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 8, cfg.d_model)
    results = {}
    for inside in (True, False):
        monkeypatch.setattr(moe, "WEIGHTS_IN_EXPERTS", inside)
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        out = layer(xs)
        out.square().sum().backward()
        results[inside] = [out, xs.grad] + [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[True][2].abs().max() > 0  # the router's gate got a gradient through the weights


@pytest.mark.parametrize("n_shared", [0, 1])
def test_the_residual_passed_in_is_added_to_the_output(n_shared):
    """The serial block hands its skip connection to the layer (the combine kernel adds it):
    layer(x, residual=r) is layer(x) + r, output and gradients."""
    cfg = tiny(n_shared_experts=n_shared)
    torch.manual_seed(0)
    layer = MoE(cfg, layer=0).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, r = torch.randn(2, 5, cfg.d_model), torch.randn(2, 5, cfg.d_model)
    results = []
    for fused in (True, False):
        layer.zero_grad()
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        out = layer(xs, residual=rs) if fused else layer(xs) + rs
        out.square().sum().backward()
        results.append([out, xs.grad, rs.grad] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_penalty_gradients_equal_the_penalties_written_into_the_loss():
    """AddAuxGrad leaves the output and the logged loss alone and gives the router what
    loss + scale * (coef * aux + z_coef * z) would give it."""
    cfg = tiny(aux_loss_coef=0.1, z_loss_coef=0.01)
    torch.manual_seed(0)
    layer = MoE(cfg, layer=0).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 8, cfg.d_model)
    set_aux_loss_scale(layer, 0.5)
    layer(x).square().sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]

    layer.zero_grad()
    h = x.view(-1, cfg.d_model)
    r = layer.router(h)
    counts = torch.bincount(r.experts.flatten(), minlength=4)
    aux = 4 * (counts / counts.sum() * r.probs.mean(0)).sum()
    z = torch.logsumexp(r.logits, -1).square().mean()
    layer.eval()(x).square().sum().add(0.5 * (0.1 * aux + 0.01 * z)).backward()
    want = [p.grad for p in layer.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    gate_without = torch.autograd.grad(layer(x).square().sum(), layer.router.gate.weight)[0]
    assert (gate_without - want[0]).abs().max() > 1e-6  # the penalties do move the router


def test_aux_free_bias_moves_load_toward_balance():
    """A router that prefers one expert: DeepSeek-V3's bias update alone (no gradient step)
    brings its share down and max/mean toward 1."""
    cfg = tiny(load_balance="aux_free", bias_update_rate=0.01, n_experts=4, top_k=1)
    torch.manual_seed(0)
    layer = MoE(cfg, layer=0).train()
    torch.nn.init.normal_(layer.router.gate.weight, std=0.1)
    u = torch.nn.functional.normalize(torch.randn(cfg.d_model), dim=0)
    layer.router.gate.weight.data[0] += u  # expert 0 scores higher for tokens along u
    x = torch.randn(4, 64, cfg.d_model) * 0.3 + u
    history = []
    for _ in range(60):
        with torch.no_grad():
            layer(x)
        history.append(end_step(layer))
    first, last = history[0], history[-1]
    assert first["layers"]["0"]["share"][0] > 0.6, first
    assert last["max_over_mean"] < 1.5 < first["max_over_mean"], (first["max_over_mean"], last["max_over_mean"])
    assert layer.router.bias[0] < 0 < layer.router.bias[1:].max()
    assert "router.bias" in layer.state_dict()  # checkpointed with the weights


def test_activation_checkpointing_keeps_loss_and_gradients():
    cfg = tiny(z_loss_coef=1e-3, n_shared_experts=1, moe_every=2)
    torch.manual_seed(0)
    plain = GPT(cfg).train()
    ckpt = GPT(cfg).train()
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ckpt)
    idx = torch.randint(0, 256, (2, 32))
    losses = []
    for model in (plain, ckpt):
        loss = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        other = grads[name.replace("blocks.1.", "blocks.1.block.").replace("blocks.0.", "blocks.0.block.")
                      .replace("blocks.2.", "blocks.2.block.")]
        torch.testing.assert_close(p.grad, other.grad, rtol=1e-5, atol=1e-7)
    assert end_step(plain)["layers"].keys() == {"1"}  # moe_every 2: only block 1 is routed


def test_parameter_counts_and_layer_choice():
    cfg = tiny(n_shared_experts=2, dense_layers=1)
    model = GPT(cfg)
    assert count_parameters(model) == expected_parameter_count(cfg)
    routed = [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)]
    assert routed == [1, 2]
    experts = 2 * 4 * 3 * 64 * 32  # two layers, 4 experts of 3 [64 x 32] matrices
    assert expected_parameter_count(cfg) - active_parameter_count(cfg) == experts // 2  # top-2 of 4 active


@pytest.mark.parametrize("update, message", [
    ({"mlp": "moe", "moe": {"n_experts": 4, "top_k": 5}}, "top_k"),
    ({"mlp": "swiglu", "moe": {"n_experts": 4}}, "routed experts need mlp: moe"),
    ({"mlp": "moe", "n_layer": 2, "moe": {"dense_layers": 2}}, "no layer"),
])
def test_bad_moe_configs_are_refused(update, message):
    with pytest.raises(ValidationError, match=message):
        ModelConfig(**update)
