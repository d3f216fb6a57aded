"""FP8 on a GPU with FP8 tensor cores (H100/H200): the converted linears really run
``torch._scaled_mm`` (forward, input gradient, weight gradient), the model keeps its function,
and the real trainer with torch.compile trains as bf16 does."""

import pytest
import torch

from megatrain.config import ConfigError, load_config
from megatrain.model.gpt import GPT
from megatrain.precision import apply_precision, check_precision_supported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = ["model.vocab_size=1024", "model.n_layer=3", "model.n_head=4", "model.d_model=256", "model.seq_len=256",
         "model.attention=full", "train.precision=fp8"]


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _scaled_mm_calls(prof) -> int:
    return sum(1 for event in prof.events() if event.name == "aten::_scaled_mm")


def test_the_hardware_check_matches_the_card():
    cfg = load_config(None, SMALL)
    if _fp8_capable():
        check_precision_supported(cfg, torch.device("cuda"))
    else:
        with pytest.raises(ConfigError, match="compute capability"):
            check_precision_supported(cfg, torch.device("cuda"))


@pytest.mark.skipif(not _fp8_capable(), reason="needs compute capability >= 8.9")
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_fp8_linears_run_scaled_mm_and_keep_the_function(block):
    cfg = load_config(None, [*SMALL, f"model.block={block}"])
    torch.manual_seed(0)
    reference = GPT(cfg.model).cuda().bfloat16()
    model = GPT(cfg.model).cuda().bfloat16()
    model.load_state_dict(reference.state_dict())
    apply_precision(model, cfg)
    idx = torch.randint(0, 1024, (4, 256), device="cuda")
    targets = torch.randint(0, 1024, (4, 256), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as forward:
        loss = model(idx, targets)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as backward:
        loss.backward()
    assert _scaled_mm_calls(forward) == 3 * 4  # every block linear, forward
    assert _scaled_mm_calls(backward) == 3 * 4 * 2  # input and weight gradients
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    ref_grads = torch.cat([p.grad.float().flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0) > 0.98


@pytest.mark.skipif(not _fp8_capable(), reason="needs compute capability >= 8.9")
def test_compiled_fp8_trainer_tracks_bf16(run_training):
    common = ["train.device=cuda", "model.compile=true", "train.steps=40", "checkpoint.interval=1000",
              "model.attention=full", "model.window=null", "data.max_source_bytes=600000"]
    bf16, _ = run_training(common, name="bf16")
    fp8, _ = run_training([*common, "train.precision=fp8", "reliability.anomaly.fp8_check_interval=1"], name="fp8")
    assert len(fp8) == len(bf16) == 40
    tail = lambda rows: sum(r["loss"] for r in rows[-5:]) / 5  # noqa: E731
    assert tail(fp8) == pytest.approx(tail(bf16), rel=3e-2)
    assert tail(fp8) < fp8[0]["loss"] - 1.0  # it learns
    assert all(r["fp8"]["fp8_nonfinite"] == 0 and r["fp8"]["fp8_underflow"] < 1e-3 for r in fp8)


@pytest.mark.skipif(not _fp8_capable(), reason="needs compute capability >= 8.9")
@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("compiled", [False, True])
def test_casting_once_and_fused_compute_what_torchao_computes(block, compiled):
    """train.fp8.casts once/fused (megatrain casts each activation once; fused: the GeLU output's
    cast in Triton) against torchao's per-linear casts, eager and with compiled blocks. The e4m3
    values are the same, but bf16 rounding elsewhere may differ (inductor fuses each graph its own
    way) and e5m2 gradients magnify it: held to a quarter of FP8's own distance from bf16."""
    torch.manual_seed(0)
    idx = torch.randint(0, 1024, (4, 256), device="cuda")
    targets = torch.randint(0, 1024, (4, 256), device="cuda")
    state, results = None, {}
    for casts in ("bf16", "torchao", "once", "fused"):
        precision = ["train.precision=bf16"] if casts == "bf16" else [f"train.fp8.casts={casts}"]
        cfg = load_config(None, [*SMALL, f"model.block={block}", *precision])
        model = GPT(cfg.model).cuda().bfloat16()
        state = state or model.state_dict()
        model.load_state_dict(state)
        apply_precision(model, cfg)
        if compiled:
            for b in model.blocks:
                b.compile(fullgraph=True)
        loss = model(idx, targets)
        loss.backward()
        results[casts] = (loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()]))

    def distance(a, b):
        return 1 - torch.nn.functional.cosine_similarity(results[a][1], results[b][1], dim=0).item()

    fp8_error = distance("torchao", "bf16")
    assert fp8_error > 0  # FP8 did run
    for casts in ("once", "fused"):
        assert results[casts][0] == pytest.approx(results["torchao"][0], rel=1e-3), casts
        assert distance(casts, "torchao") < 0.25 * fp8_error, (casts, distance(casts, "torchao"), fp8_error)
