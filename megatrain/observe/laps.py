"""Seconds per part of a piece of work, into a dict a record carries (a restore's phases in
``restores.jsonl``). On a GPU each lap first waits for the device, so a part's time includes the
copies it queued instead of leaking them into the next part's."""

from __future__ import annotations

import time

import torch


class Laps:
    def __init__(self, seconds: dict[str, float] | None, cuda: bool = False):
        self.seconds, self.cuda, self.start = seconds, cuda, time.perf_counter()

    def lap(self, part: str) -> None:
        """``<part>_s``: the time since the last lap (nothing when ``seconds`` is None)."""
        if self.seconds is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[f"{part}_s"] = round(now - self.start, 4)
        self.start = now
