"""The trainer end to end, on real text through the real data pipeline and DeepSpeed."""

import pytest

SMALL = ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=1000"]


@pytest.mark.slow
def test_tiny_recipe_loss_falls_clearly_in_100_steps(run_training):
    metrics, _ = run_training(["data.max_source_bytes=1000000", "checkpoint.interval=1000"])
    assert [m["step"] for m in metrics] == list(range(1, 101))
    first = sum(m["loss"] for m in metrics[:10]) / 10
    last = sum(m["loss"] for m in metrics[-10:]) / 10
    # from ~ln(vocab) = 7.6 nats; a model that learns nothing stays there
    assert first > 6.5
    assert last < first - 1.5, (first, last)
    assert all(m["tokens_per_s"] > 0 for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_two_process_zero1_matches_one_process(run_training, optimizer):
    common = SMALL + [f"optim.name={optimizer}", "optim.lr=3e-3", "train.steps=5", "train.micro_batch_size=4",
                      "train.global_batch_size=8", "parallel.zero_stage=1", "optim.warmup_steps=2"]
    single, _ = run_training(common, nproc=1, name="single")
    double, _ = run_training(common, nproc=2, name="double")
    assert len(single) == len(double) == 5
    for a, b in zip(single, double):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert single[-1]["loss"] < single[0]["loss"]


@pytest.mark.slow
def test_runs_are_deterministic_under_a_seed(run_training):
    common = SMALL + ["train.steps=3"]
    a, _ = run_training(common, name="a")
    b, _ = run_training(common, name="b")
    assert [m["loss"] for m in a] == [m["loss"] for m in b]


def test_bad_config_fails_before_training_and_names_the_field(run_training):
    _, proc = run_training(["model.n_head=5"], check=False)
    assert proc.returncode == 2
    assert "model: Value error, d_model (128) must be divisible by n_head (5)" in proc.stderr
