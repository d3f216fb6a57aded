"""Find straggler ranks: ranks whose compute is persistently slower than their peers'.

In synchronous training every rank waits for the slowest one at each collective, so one slow
GPU (thermal throttling, a bad PCIe link, a noisy neighbour) slows the whole job. MegaScale
found these with a per-rank heat map of step timings; this module computes the same signal.

Input: a matrix of ``steps x ranks`` compute seconds (time in the rank's own work, excluding
waits on collectives - a straggler's peers show long *waits*, not long compute). For each step
a rank's robust z-score against the others is ``(t - median) / (1.4826 * MAD)`` across ranks;
a rank is a straggler when, in the recent window after warm-up, most of its steps are both
``zscore`` sigmas and ``min_slowdown`` (relative) above the median. The relative floor keeps a
few-percent jitter from being flagged when the ranks happen to agree closely.

``slow_ranks`` is the one detector behind both straggler paths: this trainer-side monitor
(``find_stragglers``, every rank's compute time each step, three ranks or more) and the heartbeat
watcher (reliability/watcher.py, each rank's forward time from its heartbeats, from two ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAD_TO_SIGMA = 1.4826


def step_zscores(timings: np.ndarray) -> np.ndarray:
    """Robust z-score of every (step, rank) against the same step's ranks."""
    timings = np.asarray(timings, dtype=float)
    median = np.median(timings, axis=1, keepdims=True)
    mad = np.median(np.abs(timings - median), axis=1, keepdims=True)
    scale = np.maximum(MAD_TO_SIGMA * mad, 1e-3 * np.abs(median) + 1e-12)
    return (timings - median) / scale


def _as_matrix(timings: np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
    matrix = np.asarray(timings, dtype=float)
    if matrix.ndim != 2:
        raise ValueError(f"timings: expected a steps x ranks matrix, got shape {matrix.shape}")
    return matrix


@dataclass(frozen=True)
class SlowRank:
    """A rank found slow. ``ratio``: the median, over its slow steps, of its time divided by the
    step's reference median (see ``slow_ranks``); ``slow_steps`` of the ``steps`` judged were slow."""

    rank: int
    ratio: float
    slow_steps: int
    steps: int


def slow_ranks(
    timings: np.ndarray | Sequence[Sequence[float]],
    *,
    min_slowdown: float,
    min_fraction: float,
    zscore: float | None = None,
) -> list[SlowRank]:
    """The ranks slow in at least ``min_fraction`` of the steps of a ``steps x ranks`` matrix of
    seconds (the caller picks the steps: after warm-up, a recent window), in rank order.

    A step is slow for a rank under one of two rules, picked by the caller:

    - ``zscore`` given (the trainer's monitor): its robust z-score against all ranks of the step
      exceeds ``zscore`` *and* its time exceeds ``1 + min_slowdown`` times the median of all
      ranks. Needs three ranks or more: with two, the median is the pair's mean and the MAD half
      their gap, so each rank's z-score is +-0.67 however far apart they are - nothing is found.
    - ``zscore`` None (the heartbeat watcher): its time exceeds ``1 + min_slowdown`` times the
      median of its *peers* (the other ranks). A plain ratio, so it works from two ranks; the
      rank itself is left out of the reference because with two ranks the median of both is
      their mean, which shrinks every gap (2.5x its peer is only 1.43x the pair's mean).

    The rule follows the caller rather than the rank count: each caller's thresholds (and the
    watcher's documented ``straggler_slowdown``) are defined under its own rule at every world
    size, so switching rules at three ranks would change the verdicts of both. The rank count
    only decides whether the chosen rule can judge at all.
    """
    matrix = _as_matrix(timings)
    steps, ranks = matrix.shape
    if steps == 0 or ranks < (2 if zscore is None else 3):
        return []  # no steps to judge, or too few ranks for "the peers" to mean anything
    if zscore is None:
        peers = np.stack([np.median(np.delete(matrix, rank, axis=1), axis=1) for rank in range(ranks)], axis=1)
        ratio = matrix / np.maximum(peers, 1e-9)
        slow = ratio > 1 + min_slowdown
    else:
        median = np.median(matrix, axis=1, keepdims=True)
        ratio = matrix / np.maximum(median, 1e-9)  # reported only: the test below is the rule
        slow = (step_zscores(matrix) > zscore) & (matrix > median * (1.0 + min_slowdown))
    found = []
    for rank in np.flatnonzero(slow.mean(axis=0) >= min_fraction):
        ratios = ratio[slow[:, rank], rank]
        # nan only when min_fraction is 0 and the rank was never slow: there is no slow ratio
        found.append(SlowRank(rank=int(rank), ratio=float(np.median(ratios)) if ratios.size else float("nan"),
                              slow_steps=int(ratios.size), steps=steps))
    return found


def find_stragglers(
    timings: np.ndarray | Sequence[Sequence[float]],
    *,
    warmup_steps: int = 5,
    window: int = 50,
    zscore: float = 3.0,
    min_slowdown: float = 0.05,
    min_fraction: float = 0.6,
) -> list[int]:
    """Ranks slower than their peers in at least ``min_fraction`` of the last ``window`` steps
    after ``warmup_steps`` (the first steps compile, warm caches and are noisy): the z-score
    rule of ``slow_ranks``."""
    recent = _as_matrix(timings)[warmup_steps:][-window:]
    found = slow_ranks(recent, min_slowdown=min_slowdown, min_fraction=min_fraction, zscore=zscore)
    return [straggler.rank for straggler in found]


def plot_heatmap(
    timings: np.ndarray | Sequence[Sequence[float]],
    path: str | Path,
    *,
    flagged: Sequence[int] | None = None,
    title: str = "compute time per rank, relative to the step's median",
) -> Path:
    """A ranks x steps heat map of ``time / median over ranks`` (1.0 = typical), straggler rows
    labelled in red. Uses the Agg canvas directly: no pyplot global state, no display."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timings = np.asarray(timings, dtype=float)
    relative = timings / np.median(timings, axis=1, keepdims=True)
    steps, ranks = relative.shape
    figure = Figure(figsize=(min(4 + steps * 0.08, 16), min(1.5 + ranks * 0.3, 12)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    spread = max(0.05, float(np.abs(relative - 1.0).max()))
    image = axes.imshow(relative.T, aspect="auto", cmap="coolwarm", vmin=1 - spread, vmax=1 + spread,
                        interpolation="nearest")
    figure.colorbar(image, ax=axes, label="time / step median")
    axes.set_xlabel("step")
    axes.set_ylabel("rank")
    axes.set_yticks(range(ranks))
    for rank, label in enumerate(axes.get_yticklabels()):
        if flagged and rank in flagged:
            label.set_color("red")
            label.set_fontweight("bold")
    axes.set_title(title + (f" (stragglers: {list(flagged)})" if flagged else ""))
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def gather_rank_times(seconds: float, group: object | None = None) -> list[float]:
    """All ranks' value of one step's compute time (call on every rank; rank 0 keeps the row).
    One float per rank: cheap enough every ``log_interval`` steps."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [float(t.item()) for t in out]


class StragglerMonitor:
    """Used by the trainer: collects every rank's compute time each step (one tiny all-gather),
    and says which ranks are stragglers; rank 0 saves the matrix and its heat map at the end."""

    def __init__(self, world_size: int, *, every: int = 10, warmup_steps: int = 5, window: int = 50) -> None:
        self.enabled = world_size >= 3  # with fewer ranks there are no "peers" to compare with
        self.every = every
        self.warmup_steps = warmup_steps
        self.window = window
        self.rows: list[list[float]] = []
        self.flagged: list[int] = []

    def observe(self, step: int, compute_s: float | None) -> list[int]:
        if not self.enabled or compute_s is None:
            return self.flagged
        self.rows.append(gather_rank_times(compute_s))
        if step % self.every == 0:  # every rank computes the same answer from the same rows
            self.flagged = find_stragglers(self.rows, warmup_steps=self.warmup_steps, window=self.window)
        return self.flagged

    def save(self, run_dir: str | Path) -> Path | None:
        if not self.rows:
            return None
        import json

        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        flagged = find_stragglers(self.rows, warmup_steps=self.warmup_steps, window=self.window)
        (out / "stragglers.json").write_text(json.dumps({"stragglers": flagged, "compute_s": self.rows}))
        return plot_heatmap(self.rows, out / "stragglers.png", flagged=flagged)
