"""configs/llama-tiny-cpu.yaml end to end: the real trainer, real text (the standard library's
source through the data pipeline), DeepSpeed; the loss must fall clearly in 100 steps."""

from pathlib import Path
import pytest

LLAMA_TINY = Path(__file__).resolve().parents[3] / "configs" / "llama-tiny-cpu.yaml"


@pytest.mark.slow
def test_llama_tiny_loss_falls_clearly_in_100_steps(run_training):
    metrics, _ = run_training(["data.max_source_bytes=1000000", "checkpoint.interval=1000"], config=LLAMA_TINY)
    assert [m["step"] for m in metrics] == list(range(1, 101))
    first = sum(m["loss"] for m in metrics[:10]) / 10
    last = sum(m["loss"] for m in metrics[-10:]) / 10
    assert first > 6.5  # ~ln(2048) = 7.6 nats at the start
    assert last < first - 1.5, (first, last)
