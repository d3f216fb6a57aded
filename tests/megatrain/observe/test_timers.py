import time

import pytest
import torch

from megatrain.observe.timers import PHASES, StepTimers

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(timers, sleeps):
    for name, seconds in sleeps.items():
        with timers.phase(name):
            time.sleep(seconds)
    return timers.end_step()


def test_cpu_reports_one_step_late_in_milliseconds():
    timers = StepTimers("cpu")
    assert _step(timers, {"data": 0.01, "forward": 0.03}) is None  # nothing finished before step 0
    times = _step(timers, {"forward": 0.001})
    assert timers.reported_index == 0
    assert set(times) == {"data", "forward", "step"}
    assert 9 <= times["data"] < 200 and 29 <= times["forward"] < 300
    assert times["step"] >= times["data"] + times["forward"] - 1e-6
    last = timers.flush()
    assert len(last) == 1 and set(last[0]) == {"forward", "step"} and timers.pending == 0


def test_repeated_phase_is_summed_and_step_spans_gaps():
    timers = StepTimers("cpu")
    _step(timers, {"data": 0.0})
    for _ in range(3):  # micro-batches
        with timers.phase("forward"):
            time.sleep(0.005)
    time.sleep(0.02)  # work no phase covers still counts in the step
    timers.end_step()
    (times,) = timers.flush()
    assert times["forward"] >= 15
    assert times["step"] >= times["forward"] + 19


def test_unknown_phase_is_an_error():
    timers = StepTimers("cpu")
    with pytest.raises(ValueError, match="unknown phase"):
        with timers.phase("fwd"):
            pass
    assert "checkpoint" in PHASES and "comm" in PHASES


def test_phase_is_recorded_when_the_body_raises():
    timers = StepTimers("cpu")
    with pytest.raises(RuntimeError):
        with timers.phase("backward"):
            raise RuntimeError("boom")
    timers.end_step()
    assert "backward" in timers.flush()[0]


@pytest.mark.gpu
@requires_cuda
def test_cuda_events_are_read_late_without_sync():
    timers = StepTimers("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    results = []
    for _ in range(4):
        with timers.phase("forward"):
            for _ in range(10):
                a = (a @ a).tanh_()
        with timers.phase("optimizer"):
            a.mul_(0.5)
        results.append(timers.end_step())
    assert results[0] is None  # step 0 is never reported at its own end
    reported = [r for r in results if r is not None] + timers.flush()
    assert len(reported) == 4
    for times in reported:
        assert times["forward"] > 0.1 and times["optimizer"] > 0
        assert times["step"] >= times["forward"]
