"""Context parallelism on 4 ranks against one process: cp=4 (ring and all-to-all) and cp=2 x tp=2,
causal and document masks, and MoE at dp=2 x cp=2 with ep 2 (EP groups = a sample's cp ranks) and
ep 4 (over both). The rank program and the comparison are test_context_parallel.py's."""

from __future__ import annotations

import pytest

from tests.megatrain.parallel.test_context_parallel import DOC, MOE, check, reference_run, run_ranks

A2A4 = {"parallel.cp": 4, "parallel.cp_mode": "alltoall", "model.n_kv_head": 4}  # 4 KV heads: divisible by cp
TP = {"parallel.cp": 2, "parallel.tp": 2, "optim.name": "adamw"}  # LAMB under tp needs ZeRO-1 (no gradients to read)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    variants = [
        {"name": "ring4", "set": {"parallel.cp": 4}},
        {"name": "ring4-doc", "set": {"parallel.cp": 4, **DOC}},
        {"name": "a2a4", "set": A2A4},
        {"name": "a2a4-doc", "set": {**A2A4, **DOC}},
        {"name": "cp2tp2", "set": TP},
        {"name": "cp2tp2-doc", "set": {**TP, **DOC}},
        {"name": "moe-cp2-ep2", "set": {**MOE, "parallel.cp": 2, "parallel.ep": 2}},
        {"name": "moe-cp2-ep4-doc", "set": {**MOE, **DOC, "parallel.cp": 2, "parallel.ep": 4}},
    ]
    return run_ranks(4, variants, tmp_path_factory.mktemp("cp4"))


def test_cp4_ring_matches_one_process(runs):
    check(runs["ring4"], reference_run({}))
    check(runs["ring4-doc"], reference_run(DOC))


def test_cp4_alltoall_matches_one_process(runs):
    check(runs["a2a4"], reference_run({"model.n_kv_head": 4}))
    check(runs["a2a4-doc"], reference_run({"model.n_kv_head": 4, **DOC}))


def test_cp2_times_tp2_matches_one_process(runs):
    """Tensor parallelism shards the matrices: the 1-D parameters' gradients and weights, and the losses, are compared."""
    check(runs["cp2tp2"], reference_run({"optim.name": "adamw"}))
    check(runs["cp2tp2-doc"], reference_run({"optim.name": "adamw", **DOC}))


def test_moe_cp2_with_expert_parallelism_matches_one_process(runs):
    """dp 2 x cp 2: every rank routes its chunks' tokens to experts on other ranks; the balance loss
    counts the whole samples' slots; the experts' gradients are the mean over the 4 replicas."""
    check(runs["moe-cp2-ep2"], reference_run(MOE))
    check(runs["moe-cp2-ep4-doc"], reference_run({**MOE, **DOC}))
