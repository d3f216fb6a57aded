"""benchmarks/convergence.py's same-start, same-data mechanics at a tiny size on the CPU, in fp32:
megatrain's GPT and transformers' GPT2LMHeadModel, loaded from megatrain's exported initial
weights and fed megatrain's batches, agree to 1e-5 relative in loss at every one of 20 steps. The
check can fail: a peer from another init, with other AdamW betas or another data order is told
apart, and a report whose batches differ is refused by the merge."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("transformers")

import convergence  # noqa: E402
import convergence_report  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("convergence")
    args = convergence.parse_args([
        "--shape", "tiny", "--steps", str(STEPS), "--batch", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--warmup", "5",
        "--eval-every", "10", "--val-windows", "8", "--max-source-bytes", "300000", "--doc-roots", "",
        "--num-workers", "1", "--work", str(work), "--out", str(work / "result"), "--device", "cpu",
        "--runs", "megatrain,peer:0,peer:1"])
    import torch._dynamo

    before = torch._dynamo.config.automatic_dynamic_shapes
    convergence.run_comparison(args, log=lambda msg: None)
    # compiled runs get a static graph per shape, and the process-wide setting is given back
    assert torch._dynamo.config.automatic_dynamic_shapes == before
    result = json.loads((work / "result.json").read_text())
    assert result["compiled_shapes"] == "static"
    return result, work


def test_same_start_same_data_gives_the_same_losses(report):
    result, _ = report
    ours, peer = result["runs"]["megatrain"], result["runs"]["peer:0"]
    assert peer["impl"] == "GPT2LMHeadModel" and ours["impl"] == "megatrain"
    assert len(ours["train_loss"]) == len(peer["train_loss"]) == STEPS
    for step, (a, b) in enumerate(zip(ours["train_loss"], peer["train_loss"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: megatrain {a} vs peer {b}"
    assert ours["train_loss"][-1] < ours["train_loss"][0] - 0.05  # it trained: agreeing while idle proves nothing
    for a, b in zip(ours["val"], peer["val"]):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]


def test_another_init_is_told_apart(report):
    result, _ = report
    ours, other = result["runs"]["megatrain"], result["runs"]["peer:1"]
    assert other["init_seed"] == 1
    assert max(abs(a - b) / b for a, b in zip(ours["train_loss"], other["train_loss"])) > 1e-3


def test_the_json_holds_the_curves_and_the_verdict(report):
    result, _ = report
    for key in ("device", "commit", "steps", "tokens_per_step", "optim", "data", "batch_crc32", "runs", "verdict",
                "seed_band", "epochs"):
        assert key in result, key
    assert len(result["batch_crc32"]) == STEPS
    assert [p["step"] for p in result["runs"]["megatrain"]["val"]] == [0, 10, 20]
    assert result["runs"]["megatrain"]["val"][1]["tokens"] == 10 * 4 * result["seq_len"]
    verdict = result["verdict"]
    assert verdict["pairs"]["megatrain_vs_peer0"]["max"] <= 1e-4
    assert verdict["band_max_abs_diff_peer0_peer1"] > 1e-3 and verdict["within_band"] is True
    assert result["data"]["val_samples"] > 0 and result["data"]["tokenizer_sha256"]
    assert result["optim"]["name"] == "adamw" and result["optim"]["weight_decay"] == 0.1


def test_merge_refuses_runs_that_read_other_batches(report, tmp_path):
    result, work = report
    other = dict(result, batch_crc32=[*result["batch_crc32"][:5], result["batch_crc32"][5] ^ 1, *result["batch_crc32"][6:]])
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="the batch of step 5 differs"):
        convergence_report.merge([str(work / "result.json"), str(tmp_path / "other.json")])


def _pair_losses(work, peer_betas=(0.9, 0.95), peer_data_seed=1234, steps=8):
    """megatrain and peer:0 trained side by side on the fixture's shards; the peer's optimizer
    betas or its data order may differ: the train losses of both."""
    import torch

    import convergence_data as data
    import convergence_models as models
    from megatrain.config import OptimConfig
    from megatrain.optim.schedule import Schedule

    cfg = models.model_config("gpt", "tiny")
    data_cfg = data.data_config(f"{work}/shards", cfg.vocab_size, max_source_bytes=300000, doc_roots=(), num_workers=1)
    index = data.build_shards(data_cfg, cfg.seq_len, cfg.vocab_size)  # the fixture's version, reused
    optim = OptimConfig(name="adamw", lr=1e-3, min_lr=1e-4, warmup_steps=5)
    schedule = Schedule.of(optim, steps)
    cpu = torch.device("cpu")
    ours = models.make_run("megatrain", "gpt", cfg, optim, data.tokenizer_bytes(index), cpu)
    peer = models.make_run("peer:0", "gpt", cfg, optim.model_copy(update={"betas": peer_betas}),
                           data.tokenizer_bytes(index), cpu)
    streams = [data.train_batches(index, data_cfg, 4, cfg.vocab_size),
               data.train_batches(index, data_cfg.model_copy(update={"seed": peer_data_seed}), 4, cfg.vocab_size)]
    losses = ([], [])
    for step in range(steps):
        for run, stream, out in zip((ours, peer), streams, losses):
            x, y, _ = next(stream)
            out.append(float(models.train_step(run, x, y, schedule.at(step), 1.0, cpu)[0]))
    for stream in streams:
        stream.close()
    return losses


def test_other_optimizer_settings_or_data_order_are_told_apart(report):
    _, work = report
    ours, peer = _pair_losses(work)
    assert max(abs(a - b) / b for a, b in zip(ours, peer)) <= 1e-5
    ours, peer = _pair_losses(work, peer_betas=(0.9, 0.999))
    assert ours[0] == peer[0] and max(abs(a - b) / b for a, b in zip(ours, peer)) > 1e-5
    ours, peer = _pair_losses(work, peer_data_seed=99)
    assert max(abs(a - b) / b for a, b in zip(ours, peer)) > 1e-3


def test_the_probe_gives_both_models_the_same_gradients_group_by_group(report, tmp_path):
    """benchmarks/convergence_probe.py on the fixture's shards: the first step's gradient norms of
    megatrain and the peer agree per tensor group (embedding, blocks, final norm), on the loader's
    shifted targets. In several processes it tells a process's state from the models' arithmetic."""
    import convergence_probe

    _, work = report
    out = tmp_path / "probe.json"
    convergence_probe.main(["--probe-out", str(out), "--shape", "tiny", "--batch", "4", "--steps", "1",
                            "--max-source-bytes", "300000", "--doc-roots", "", "--num-workers", "1",
                            "--work", str(work), "--device", "cpu", "--runs", "megatrain:0,peer:0,peer:1"])
    (row,) = json.loads(out.read_text())
    assert row["targets_equal_shifted_inputs"]
    ours, peer, other = (row["runs"][name] for name in ("megatrain:0", "peer:0", "peer:1"))
    assert set(ours["groups"]) == set(peer["groups"]) >= {"embedding", "block 0", "last block", "final norm"}
    for group, norm in ours["groups"].items():
        assert abs(norm - peer["groups"][group]) <= 1e-5 * norm, (group, norm, peer["groups"][group])
    assert abs(ours["grad_norm"] - other["grad_norm"]) > 1e-3 * ours["grad_norm"]  # another init is told apart
