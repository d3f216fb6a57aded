"""benchmarks/long_context_memory.py on CPU at a tiny size: the table and JSON, and the real check of
``megatrain/parallel/plan_activations.py``: for every checkpointing policy, the stored activations
the plan predicts agree within 10% with the bytes a training step of the model really keeps alive
after its forward (counted storage by storage, by part: embedding, blocks, head and loss), also with
ring attention's terms (a one-rank gloo group holding the tokens of a cp=2 rank)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import long_context_memory as bench  # noqa: E402
from long_context_measure import train_steps  # noqa: E402

from megatrain.config import load_config  # noqa: E402
from megatrain.parallel.context_parallel import cp_sequence  # noqa: E402
from megatrain.parallel.plan_activations import POLICIES, activation_plan, with_policy  # noqa: E402

TINY_LLAMA = str(ROOT / "configs" / "llama-tiny-cpu.yaml")


def within(measured: float, predicted: float, tolerance: float = 0.10) -> bool:
    return abs(measured - predicted) <= tolerance * predicted


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lcm") / "report.json"
    assert bench.main(["--device", "cpu", "--tiny", "--config", TINY_LLAMA, "--seq", "128", "--steps", "1",
                       "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_table_and_json(report, capsys):
    assert [r["policy"] for r in report["rows"]] == list(POLICIES)
    assert set(report["target"]["policies"]) == set(POLICIES)
    full = report["target"]["policies"]["full"]
    assert full["predicted_bytes"] < report["target"]["policies"]["none"]["predicted_bytes"]
    table = bench.table(report["rows"], report["target"])
    assert "| 128 | selective |" in table and "parallel.cp=8" in table


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_agrees_with_the_stored_bytes(report, policy):
    row = next(r for r in report["rows"] if r["policy"] == policy)
    for part, predicted in row["predicted_stored"].items():
        measured = row["measured_stored"][part]
        assert within(measured, predicted), (policy, part, measured, predicted)
    # the check can fail: another policy's prediction is far from this policy's measurement
    for other in POLICIES:
        other_row = next(r for r in report["rows"] if r["policy"] == other)
        if other_row["predicted_stored"]["blocks"] != row["predicted_stored"]["blocks"]:
            assert not within(row["measured_stored"]["blocks"], other_row["predicted_stored"]["blocks"])


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.new_group([0])
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ring_terms_agree_for_every_policy(one_rank_group, dtype):
    """A cp=2 rank holds seq/2 tokens; the ring on a one-rank group stores what each rank stores."""
    base = load_config(TINY_LLAMA, ["model.n_layer=4", "model.compile=false", "train.micro_batch_size=2",
                                    f"train.dtype={dtype}", "model.kernels.cross_entropy=chunked"])
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    for policy in POLICIES:
        cfg = with_policy(base, policy)
        measured = train_steps(cfg, torch.device("cpu"), torch_dtype, steps=1,
                               sequence_fn=lambda T: cp_sequence(torch.arange(T), None, "ring", one_rank_group))
        rank_of_cp2 = load_config(TINY_LLAMA, ["model.n_layer=4", "model.seq_len=256", "train.seq_len=256",
                                               "parallel.cp=2", "train.micro_batch_size=2", f"train.dtype={dtype}",
                                               "model.kernels.cross_entropy=chunked"])
        plan = activation_plan(with_policy(rank_of_cp2, policy), reference=True)
        predicted = bench.by_part(plan)
        for part in bench.PARTS:
            assert within(measured.stored.get(part, 0), predicted[part]), (policy, part, measured.stored, predicted)
