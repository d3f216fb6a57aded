"""Parallel == serial: DP2, TP2, PP2, TP2xDP2, PP2xDP2 (and TP2xPP2) runs of 3 LAMB steps with
ZeRO-1 and gradient clipping match one process on the same global batch, with every overlap on
and off, both block kinds, sequence parallelism on and off; and the Llama family (RoPE, RMSNorm,
SwiGLU, grouped-query attention with its KV heads split over TP ranks) in a lean set of layouts:
ZeRO-3, TP+SP, TP without SP with a sliding window, PP untied, TP2xDP2 ZeRO-2, TP2xPP2.

Each world size is one torchrun launch that trains all its variants (process start-up and
imports cost ~10 s per launch on 2 cores; a variant costs about a second). The reference is
plain torch in this process (conftest.reference_run), so DeepSpeed's accumulation, clipping and
ZeRO-1 are checked along with our tensor and pipeline parallelism.

Tolerances, all norm-wise relative errors ||a - b|| / ||b|| (fp32; measured values are ~1e-7
for losses and 1e-7..5e-7 for gradients and weights - summation order differs across shards):
losses, gradient norms, sampled step-1 gradients and all final weights within 1e-5. One slice
is excluded from the weight comparison: the attention key bias. Its gradient is exactly zero in
exact arithmetic (adding b_k to every key adds q.b_k to every score of a query, which softmax
ignores), so in floating point it is rounding noise, which LAMB normalises into lr-sized steps
of arbitrary sign. Its gradient is still compared (as part of qkv.bias, where noise is tiny).
"""

from __future__ import annotations

import pytest
import torch

from tests.megatrain.parallel.conftest import reference_run, run_parity

OFF = {"parallel.overlap.tp_chunks": 1, "parallel.overlap.dp_overlap_comm": False, "parallel.overlap.dp_prefetch": False}
TP2, PP2, SERIAL, NO_SP = {"parallel.tp": 2}, {"parallel.pp": 2}, {"model.block": "serial"}, {"parallel.sequence_parallel": False}
DOCUMENT = {"model.attention_mask": "document"}
# The Llama family: RoPE, RMSNorm, SwiGLU, 4 query heads over 2 KV heads (one KV head per TP rank), no biases
LLAMA = {"model.position": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu", "model.n_kv_head": 2,
         "model.bias": False, "model.d_ff": 48}

WORLD2 = {
    "dp2": {},
    "dp2-overlap-off": OFF,
    "dp2-zero0-overlap": {"parallel.zero_stage": 0},  # our bucketed all-reduce during backward
    "dp2-zero0-overlap-off": {"parallel.zero_stage": 0, **OFF},  # DeepSpeed's all-reduce after backward
    "dp2-zero0-overlap-1-micro-batch": {"parallel.zero_stage": 0, "train.micro_batch_size": 4},
    "dp2-zero3-adamw-prefetch": {"parallel.zero_stage": 3, "optim.name": "adamw"},
    "dp2-zero3-adamw-overlap-off": {"parallel.zero_stage": 3, "optim.name": "adamw", **OFF},
    "tp2-parallel-sp": TP2,
    "tp2-parallel-sp-overlap-off": {**TP2, **OFF},
    "tp2-parallel-nosp": {**TP2, **NO_SP},
    "tp2-parallel-nosp-overlap-off": {**TP2, **NO_SP, **OFF},
    "tp2-serial-sp": {**TP2, **SERIAL},
    "tp2-serial-sp-3-chunks": {**TP2, **SERIAL, "parallel.overlap.tp_chunks": 3},  # 8 rows -> 3 + 3 + 2
    "tp2-serial-sp-overlap-off": {**TP2, **SERIAL, **OFF},
    "tp2-serial-nosp": {**TP2, **SERIAL, **NO_SP},
    "tp2-parallel-sp-checkpointed": {**TP2, "model.activation_checkpointing": True},
    "tp2-serial-sp-checkpointed": {**TP2, **SERIAL, "model.activation_checkpointing": True},
    "pp2": PP2,
    "pp2-overlap-off": {**PP2, **OFF},
    "pp2-serial-checkpointed": {**PP2, **SERIAL, "model.activation_checkpointing": True},
    "pp2-untied": {**PP2, "model.tie_embeddings": False},
    "llama-dp2-zero3-adamw": {**LLAMA, **SERIAL, "parallel.zero_stage": 3, "optim.name": "adamw"},
    "llama-tp2-serial-sp": {**LLAMA, **SERIAL, **TP2},
    "llama-tp2-parallel-nosp-sliding": {**LLAMA, **TP2, **NO_SP, "model.attention": "sliding", "model.window": 6},
    "llama-pp2-serial-untied": {**LLAMA, **SERIAL, **PP2, "model.tie_embeddings": False},
    # the document mask inside the pipeline: the ids travel with the activations (pipeline.py)
    "pp2-document": {**PP2, **DOCUMENT},
    "llama-pp2-document-untied-selective": {**LLAMA, **SERIAL, **PP2, **DOCUMENT, "model.tie_embeddings": False,
                                            "model.activation_checkpointing": "selective"},
}
WORLD4 = {
    "tp2xdp2-parallel-sp": TP2,
    "tp2xdp2-serial-sp-overlap-off": {**TP2, **SERIAL, **OFF},
    "tp2xdp2-parallel-sp-zero2": {**TP2, "parallel.zero_stage": 2},
    "tp2xdp2-zero0-adamw-overlap": {**TP2, "parallel.zero_stage": 0, "optim.name": "adamw"},
    "pp2xdp2": PP2,
    "pp2xdp2-overlap-off": {**PP2, **OFF},
    "tp2xpp2-sp": {**TP2, **PP2},
    "tp2xpp2-nosp": {**TP2, **PP2, **NO_SP},  # DeepSpeed partitions activations between stages
    "tp2xpp2-sp-checkpointed": {**TP2, **PP2, "model.activation_checkpointing": True},
    "llama-tp2xdp2-serial-sp-zero2": {**LLAMA, **SERIAL, **TP2, "parallel.zero_stage": 2},
    "llama-tp2xpp2-parallel-sp": {**LLAMA, **TP2, **PP2},
    # context parallelism inside the pipeline's stages: learned positions (tied) and RoPE (untied), ring and all-to-all
    "pp2xcp2-ring": {**PP2, "parallel.cp": 2},
    "pp2xcp2-alltoall-checkpointed": {**PP2, "parallel.cp": 2, "parallel.cp_mode": "alltoall",
                                      "model.activation_checkpointing": True},
    "llama-pp2xcp2-ring-untied": {**LLAMA, **SERIAL, **PP2, "parallel.cp": 2, "model.tie_embeddings": False},
    "pp2xcp2-ring-document-checkpointed": {**PP2, **DOCUMENT, "parallel.cp": 2, "model.activation_checkpointing": True},
    "llama-tp2xpp2-sp-document-sliding": {**LLAMA, **TP2, **PP2, **DOCUMENT, "model.attention": "sliding",
                                          "model.window": 6},
}
SWAPPED = {"pp2xcp2-ring-swapped-chunks": {**PP2, "parallel.cp": 2}}  # must NOT match (test below)
DROPPED = {"pp2-document-ids-dropped": {**PP2, **DOCUMENT}}  # must NOT match either
TOLERANCE = 1e-5


EXPECT_DP_OVERLAP = {"dp2-zero0-overlap": True, "dp2-zero0-overlap-1-micro-batch": True,
                     "dp2-zero0-overlap-off": False, "tp2xdp2-zero0-adamw-overlap": True, "dp2": False}


def variants(table: dict[str, dict]) -> list[dict]:
    return [{"name": name, "set": overrides, "expect_dp_overlap": EXPECT_DP_OVERLAP.get(name)}
            for name, overrides in table.items()]


@pytest.fixture(scope="session")
def world2(tmp_path_factory) -> dict[str, dict]:
    dropped = [{"name": name, "set": overrides, "drop_doc_ids": True} for name, overrides in DROPPED.items()]
    return run_parity(2, variants(WORLD2) + dropped, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="session")
def world4(tmp_path_factory) -> dict[str, dict]:
    swapped = [{"name": name, "set": overrides, "swap_chunks": True} for name, overrides in SWAPPED.items()]
    return run_parity(4, variants(WORLD4) + swapped, tmp_path_factory.mktemp("world4"))


@pytest.fixture(scope="session")
def reference():
    """The single-process run for a variant's model and optimizer settings (parallel settings
    and activation checkpointing change no math)."""
    cache: dict[tuple, dict] = {}

    def get(overrides: dict) -> dict:
        math = {k: v for k, v in overrides.items() if k.startswith(("model.", "optim.")) and "checkpointing" not in k}
        key = tuple(sorted(math.items()))
        if key not in cache:
            cache[key] = reference_run({"set": math})
        return cache[key]

    return get


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not name.endswith("attn.qkv.bias"):
        return tensor
    third = tensor.shape[0] // 3
    return torch.cat([tensor[:third], tensor[2 * third :]])  # q and v; k is noise (module docstring)


def assert_matches(run: dict, ref: dict) -> None:
    assert len(run["loss"]) == len(ref["loss"]) == 3
    for step, (got, want) in enumerate(zip(run["loss"], ref["loss"])):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step + 1} loss {got} != {want}"
    for step, (got, want) in enumerate(zip(run["grad_norm"], ref["grad_norm"])):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step + 1} grad norm {got} != {want}"
    assert set(run["grads"]) == set(ref["grads"]), "sampled gradients"
    for name, grad in run["grads"].items():
        assert relative_error(grad, ref["grads"][name]) <= TOLERANCE, f"gradient of {name}"
    assert set(run["weights"]) == set(ref["weights"]), "parameters held by the run"
    for name, weight in run["weights"].items():
        err = relative_error(without_key_bias(name, weight), without_key_bias(name, ref["weights"][name]))
        assert err <= TOLERANCE, f"{name} after 3 steps: relative error {err:.2e}"


@pytest.mark.slow
def test_the_foreach_norms_match_deepspeeds_own(world2, world4):
    """parallel/zero_norms.py on every ZeRO-1/2 layout (dp, tp, pp, tp x dp, tp x pp): the gradient norm
    DeepSpeed's own per-tensor fp64 code gives, and the same verdicts with a NaN, an inf or a huge
    finite value planted in a gradient (overflow or not; the norm DeepSpeed's -1)."""
    checked = {name: run["norm_check"] for name, run in {**world2, **world4}.items() if run["norm_check"]}
    assert len(checked) >= 20, sorted(checked)  # every layout but ZeRO-0 and ZeRO-3
    for name, check in checked.items():
        assert check["ours"] == pytest.approx(check["theirs"], rel=1e-6), name
        assert not check["overflow_clean_ours"] and not check["overflow_clean_theirs"], name
        for planted in ("nan", "inf"):
            assert check[f"overflow_{planted}_ours"] and check[f"overflow_{planted}_theirs"], (name, planted)
            assert check[f"norm_{planted}_ours"] == check[f"norm_{planted}_theirs"] == -1.0, (name, planted)
        # finite, so no overflow; its square overflows the fp32 total: DeepSpeed's -1, which its step refuses
        assert not check["overflow_huge_ours"] and not check["overflow_huge_theirs"], name
        assert check["norm_huge_ours"] == check["norm_huge_theirs"] == -1.0, name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_match_one_process(name, world2, reference):
    assert_matches(world2[name], reference(WORLD2[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_match_one_process(name, world4, reference):
    assert_matches(world4[name], reference(WORLD4[name]))


@pytest.mark.slow
def test_variants_really_differ_from_each_other(world2, reference):
    """Guards against a vacuous comparison: the block kinds train to different losses, and the
    weights move well beyond the tolerance in 3 steps."""
    parallel, serial = reference({}), reference(SERIAL)
    assert abs(parallel["loss"][2] - serial["loss"][2]) > 1e-4
    assert abs(reference({**LLAMA, **SERIAL})["loss"][2] - serial["loss"][2]) > 1e-4
    torch.manual_seed(1234)
    from parity_worker import GPT, build_config

    initial = dict(GPT(build_config({}, 1).model).named_parameters())
    moved = relative_error(world2["dp2"]["weights"]["blocks.0.mlp.fc.weight"], initial["blocks.0.mlp.fc.weight"].detach())
    assert moved > 100 * TOLERANCE


@pytest.mark.slow
def test_a_misplaced_context_chunk_inside_the_pipeline_fails_the_comparison(world4, reference):
    """The cp rank's two chunks exchanged (tokens moved, positions kept): the comparison that
    pp2xcp2-ring passes must fail, so it sees where each chunk sits."""
    (name, overrides), = SWAPPED.items()
    with pytest.raises(AssertionError):
        assert_matches(world4[name], reference(overrides))


@pytest.mark.slow
def test_document_ids_lost_inside_the_pipeline_fail_the_comparison(world2, reference):
    """The stages fed one document per sample instead of the batch's ids (plain causal attention on
    the same batches): the comparison that pp2-document passes must fail, so it sees the mask."""
    (name, overrides), = DROPPED.items()
    with pytest.raises(AssertionError):
        assert_matches(world2[name], reference(overrides))
