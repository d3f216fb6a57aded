"""Straggler detection on synthetic per-rank step timings, and the heat map."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatrain.observe.straggler import find_stragglers, plot_heatmap, step_zscores


def timings(steps: int, ranks: int, slow: dict[int, float], seed: int, noise: float = 0.03) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = 0.5 + 0.05 * rng.standard_normal((steps, 1))  # step-to-step variation shared by all ranks
    out = base * (1 + noise * rng.standard_normal((steps, ranks)))
    out[:5] *= 3  # warm-up steps: compile, caches
    for rank, factor in slow.items():
        out[5:, rank] *= factor
    return out


@pytest.mark.parametrize("seed", range(10))
def test_one_rank_slowed_20_percent(seed: int) -> None:
    assert find_stragglers(timings(80, 4, {2: 1.2}, seed)) == [2]


@pytest.mark.parametrize("seed", range(10))
def test_no_straggler(seed: int) -> None:
    assert find_stragglers(timings(80, 4, {}, seed)) == []


def test_edge_cases() -> None:
    assert find_stragglers(np.ones((3, 4))) == []  # nothing after warm-up
    assert find_stragglers(np.ones((20, 2))) == []  # two ranks: no majority to compare with
    assert find_stragglers(np.ones((20, 8))) == []  # identical ranks
    with pytest.raises(ValueError, match="steps x ranks"):
        find_stragglers(np.ones(5))
    z = step_zscores(np.array([[1.0, 1.0, 1.0, 2.0]]))
    assert z[0, 3] > 100 and z[0, 0] == 0


def test_heatmap_png(tmp_path: Path) -> None:
    data = timings(60, 8, {5: 1.3}, seed=0)
    flagged = find_stragglers(data)
    assert flagged == [5]
    path = plot_heatmap(data, tmp_path / "heat" / "ranks.png", flagged=flagged)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
