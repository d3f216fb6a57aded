"""Per-phase step timers that never stall the GPU.

    timers = StepTimers(device)
    for step in ...:
        with timers.phase("data"): batch = next(loader)
        with timers.phase("forward"): loss = model(batch)
        with timers.phase("backward"): loss.backward()
        with timers.phase("optimizer"): opt.step()
        times = timers.end_step()   # the PREVIOUS step's {"forward": ms, ..., "step": ms}, or None

On CUDA each phase records a start and an end event on the current stream. Reading an event's
time needs the GPU to have reached it; asking right away would synchronise and drain the queue
the CPU has built ahead. So ``end_step`` reports a step only once all its events have completed
(``Event.query()``, which never blocks): normally the step before the one just ended, since the
GPU finishes step N-1 while the CPU enqueues step N. A step the GPU has not finished yet is kept
and reported by a later ``end_step`` (oldest first); ``flush()`` synchronises and returns all
that are left (end of training, tests).

On CPU the same API times with ``time.perf_counter`` and reports the previous step as well, so
callers see one behaviour.

Times are milliseconds. A phase entered several times in a step (one forward per micro-batch)
is summed. ``"step"`` is the time from the previous step's end marker to this one's (GPU
timeline on CUDA), i.e. the full step including gaps no phase covers; the first step measures
from its first phase instead.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

PHASES = ("data", "forward", "backward", "optimizer", "pipeline", "comm", "checkpoint")


@dataclass
class _Step:
    index: int
    spans: list[tuple[str, object, object]] = field(default_factory=list)  # (phase, start, end)
    begin: object = None  # the previous step's end marker (or this step's first start)
    end: object = None  # this step's end marker


class StepTimers:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._step = _Step(index=0)
        self._last_marker: object = None
        self._pending: deque[_Step] = deque()  # ended, not yet reported
        self._held_back = 1  # report only steps older than the one just ended (one step late)
        self.reported_index: int | None = None  # which step (counting from 0) end_step last returned

    # -- recording ---------------------------------------------------------------------------
    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed code as phase ``name`` (one of PHASES) of the current step."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
        start = self._mark()
        if self._step.begin is None:
            self._step.begin = self._last_marker if self._last_marker is not None else start
        try:
            yield
        finally:
            self._step.spans.append((name, start, self._mark()))

    def end_step(self) -> dict[str, float] | None:
        """Close the current step; return the oldest finished earlier step's times, or None.

        Never blocks: on CUDA a step whose events the GPU has not reached stays pending."""
        step = self._step
        step.end = self._mark()
        if step.begin is None:  # a step with no phases: measure from the last marker
            step.begin = self._last_marker if self._last_marker is not None else step.end
        self._last_marker = step.end
        self._pending.append(step)
        self._step = _Step(index=step.index + 1)
        if len(self._pending) > self._held_back and self._ready(self._pending[0]):
            return self._report(self._pending.popleft())
        return None

    def flush(self) -> list[dict[str, float]]:
        """Synchronise and return every step not yet reported (oldest first)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        out = [self._report(s) for s in self._pending]
        self._pending.clear()
        return out

    @property
    def pending(self) -> int:
        """Ended steps not reported yet."""
        return len(self._pending)

    # -- reading -----------------------------------------------------------------------------
    def _ready(self, step: _Step) -> bool:
        # Events complete in stream order, so the step's end marker being done means every
        # event before it on that stream is too; spans on other streams are checked one by one.
        if not self.cuda:
            return True
        return step.end.query() and all(end.query() for _, _, end in step.spans)

    def _elapsed(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0

    def _report(self, step: _Step) -> dict[str, float]:
        times: dict[str, float] = {}
        for name, start, end in step.spans:
            times[name] = times.get(name, 0.0) + self._elapsed(start, end)
        times["step"] = self._elapsed(step.begin, step.end)
        self.reported_index = step.index
        return times
