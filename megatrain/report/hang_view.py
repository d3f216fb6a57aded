"""Who hung? The 3D-parallel picture of every rank's last heartbeat.

When a job stops advancing, every rank soon waits inside some collective, so "which ranks are
stuck" is everyone; the useful question is which rank the others wait for. Drawing ranks in
their parallel layout makes that visible: one panel per pipeline stage, rows = data-parallel
rank, columns = tensor-parallel rank, each cell showing the last phase and step. Silent (dead
or never seen) and hung ranks are red; the likely culprits get a thick border:

- a dead or missing rank, if there is one (its peers wait for it forever);
- otherwise, among hung ranks, those on the lowest step, preferring ranks that are *not* in
  ``collective`` when the others are (they are still computing - or stuck - while peers wait).

The same grid renders as markdown, for logs and a Prefect markdown artifact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from megatrain.reliability.heartbeat import HeartbeatRecord
from megatrain.reliability.watcher import WatchResult

COLORS = {"ok": "#b7e4c7", "hung": "#ff6b6b", "dead": "#c1121f", "missing": "#c1121f", "frozen": "#c1121f",
          "waiting": "#ffd166"}


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a rank in the usual Megatron order: tp varies fastest, then dp, then
        pp. Used only when a heartbeat does not carry its own coordinates."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp


@dataclass
class Cell:
    rank: int
    pp: int
    dp: int
    tp: int
    status: str  # ok | hung | dead | missing | frozen (stopped: no beat, no step) | waiting (for a frozen peer)
    phase: str | None
    step: int | None
    suspect: bool = False

    @property
    def faulty(self) -> bool:
        return self.status not in ("ok", "waiting")


def hang_grid(
    records: Mapping[int, HeartbeatRecord],
    layout: Layout,
    *,
    dead: Iterable[int] = (),
    hung: Iterable[int] = (),
    missing: Iterable[int] = (),
    frozen: Iterable[int] = (),
    waiting: Iterable[int] = (),
) -> list[Cell]:
    """One cell per rank of the layout, with its status and the suspects marked."""
    status = {rank: "waiting" for rank in waiting} | {rank: "hung" for rank in hung} | {rank: "dead" for rank in dead}
    status |= {rank: "missing" for rank in missing} | {rank: "frozen" for rank in frozen}
    cells = []
    for rank in range(layout.world_size):
        record = records.get(rank)
        pp, dp, tp = layout.coords(rank)
        if record is not None and None not in (record.pp_rank, record.dp_rank, record.tp_rank):
            pp, dp, tp = record.pp_rank, record.dp_rank, record.tp_rank  # type: ignore[assignment]
        cells.append(Cell(
            rank=rank, pp=pp, dp=dp, tp=tp,
            status=status.get(rank, "ok" if record is not None else "missing"),
            phase=record.phase if record else None,
            step=record.step if record else None,
        ))
    for cell in _suspects(cells):
        cell.suspect = True
    return cells


def grid_from_watch(result: WatchResult, layout: Layout) -> list[Cell]:
    return hang_grid(result.records, layout, dead=result.dead, hung=result.hung, missing=result.missing,
                     frozen=result.frozen, waiting=result.waiting)


def _suspects(cells: list[Cell]) -> list[Cell]:
    silent = [cell for cell in cells if cell.status in ("dead", "missing", "frozen")]
    if silent:
        return silent
    hung = [cell for cell in cells if cell.status == "hung"]
    if not hung:
        return []
    lowest = min(cell.step or 0 for cell in hung)
    behind = [cell for cell in hung if (cell.step or 0) == lowest]
    computing = [cell for cell in behind if cell.phase != "collective"]
    return computing if computing and len(computing) < len(hung) else behind


def _label(cell: Cell) -> str:
    if cell.phase is None:
        return f"r{cell.rank} (no heartbeat)"
    return f"r{cell.rank} {cell.phase} @{cell.step}"


def render_markdown(cells: list[Cell], layout: Layout) -> str:
    """Markdown tables, one per pipeline stage: rows dp, columns tp."""
    by_coords = {(cell.pp, cell.dp, cell.tp): cell for cell in cells}
    faulty = [cell.rank for cell in cells if cell.faulty]
    suspects = [cell.rank for cell in cells if cell.suspect]
    lines = ["## Who hung", "", f"faulty ranks: {faulty or 'none'}; suspects: {suspects or 'none'}", ""]
    for pp in range(layout.pp):
        lines += [f"### pipeline stage {pp}", "",
                  "| dp \\ tp | " + " | ".join(f"tp {tp}" for tp in range(layout.tp)) + " |",
                  "|---" * (layout.tp + 1) + "|"]
        for dp in range(layout.dp):
            row = []
            for tp in range(layout.tp):
                cell = by_coords.get((pp, dp, tp))
                if cell is None:
                    row.append("-")
                    continue
                text = _label(cell)
                if cell.faulty:
                    text = f"**{cell.status.upper()}** {text}"
                if cell.suspect:
                    text += " (suspect)"
                row.append(text)
            lines.append(f"| dp {dp} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_hang_grid(cells: list[Cell], layout: Layout, path: str | Path) -> Path:
    """PNG: one panel per pipeline stage, faulty ranks red, suspects with a thick border."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    width = max(3.0, 1.9 * layout.tp) * layout.pp
    figure = Figure(figsize=(min(width, 24), min(1.0 + 0.9 * layout.dp, 16)))
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, layout.pp, squeeze=False)[0]
    for pp, axes in enumerate(panels):
        axes.set_xlim(0, layout.tp)
        axes.set_ylim(layout.dp, 0)
        axes.set_xticks([tp + 0.5 for tp in range(layout.tp)], [f"tp {tp}" for tp in range(layout.tp)])
        axes.set_yticks([dp + 0.5 for dp in range(layout.dp)], [f"dp {dp}" for dp in range(layout.dp)])
        axes.set_title(f"pipeline stage {pp}")
        for cell in (c for c in cells if c.pp == pp):
            axes.add_patch(Rectangle(
                (cell.tp, cell.dp), 1, 1, facecolor=COLORS[cell.status], edgecolor="black",
                linewidth=3.5 if cell.suspect else 0.5,
            ))
            text = _label(cell).replace(" ", "\n", 1)
            if cell.faulty:
                text += f"\n{cell.status.upper()}"
            axes.text(cell.tp + 0.5, cell.dp + 0.5, text, ha="center", va="center", fontsize=8,
                      color="white" if cell.status in ("dead", "missing") else "black")
    faulty = [cell.rank for cell in cells if cell.faulty]
    figure.suptitle(f"last heartbeat per rank - faulty: {faulty or 'none'} (thick border: suspect)")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
