"""The 'who hung' grid: ranks placed by (pp, dp, tp), faulty ones marked, suspects found."""

from __future__ import annotations

import time
from pathlib import Path

from megatrain.report.hang_view import Layout, grid_from_watch, hang_grid, plot_hang_grid, render_markdown
from megatrain.reliability.heartbeat import DirectorySink, HeartbeatRecord
from megatrain.reliability.watcher import HeartbeatWatcher


def test_layout_coords() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    assert [layout.coords(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]


def test_silent_rank_is_marked_and_suspected(tmp_path: Path) -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    now = time.time()
    sink = DirectorySink(tmp_path / "hb")
    for rank in range(8):
        if rank == 5:  # died in the middle of step 41's forward
            sink.publish(HeartbeatRecord(rank, step=41, phase="forward", timestamp=now - 60, step_since=now - 61))
        else:  # everyone else waits for it in a collective
            sink.publish(HeartbeatRecord(rank, step=41, phase="collective", timestamp=now, step_since=now - 60))
    result = HeartbeatWatcher(sink, 8, timeout_s=30, since=0).check()
    assert result.dead == [5] and result.hung == [0, 1, 2, 3, 4, 6, 7]
    cells = grid_from_watch(result, layout)
    assert [c.rank for c in cells if c.suspect] == [5]

    markdown = render_markdown(cells, layout)
    assert "### pipeline stage 1" in markdown
    assert "| dp 0 | **HUNG** r4 collective @41 | **DEAD** r5 forward @41 (suspect) |" in markdown
    assert "suspects: [5]" in markdown

    png = plot_hang_grid(cells, layout, tmp_path / "who_hung.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


def test_hung_rank_still_computing_is_the_suspect() -> None:
    layout = Layout(pp=1, dp=2, tp=2)
    records = {r: HeartbeatRecord(r, step=7, phase="collective", dp_rank=r // 2, tp_rank=r % 2, pp_rank=0)
               for r in range(4)}
    records[2].phase = "backward"
    cells = hang_grid(records, layout, hung=[0, 1, 2, 3])
    assert [c.rank for c in cells if c.suspect] == [2]
    assert "**HUNG** r2 backward @7 (suspect)" in render_markdown(cells, layout)
    # a rank that never reported is missing, and it is the suspect
    del records[3]
    cells = hang_grid(records, layout, hung=[0, 1, 2])
    assert [(c.rank, c.status) for c in cells if c.suspect] == [(3, "missing")]
    assert "no faulty" not in render_markdown(hang_grid(records, layout), layout)
