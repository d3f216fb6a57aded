"""Expert load of an MoE stage as a heat map: MoE layers x experts, each cell the expert's share
of the layer's routed slots over the stage (the mean of its logged steps' shares, on the timeline
that survived restarts and rollbacks: ``read_metrics``).

A balanced router puts 1 / n_experts in every cell; a collapsing one shows one bright column,
dead experts dark ones. The colour is the load relative to balanced (share x n_experts,
max/mean in the metrics' terms): white at 1, full blue at 0 (a dead expert), full red at the
worst load (at least 2x), so "too much" and "too little" read at a glance whatever the expert count. Drawn with the Agg canvas (no pyplot state). No torch.
"""

from __future__ import annotations

from pathlib import Path

from megatrain.report.runs import read_metrics

TITLE = "expert load"  # the campaign report's picture title is "<stage>: expert load"


def stage_expert_load(run_dir: str | Path) -> dict[int, list[float]]:
    """{layer: [mean share of each expert]} over the stage's steps; {} for a dense stage."""
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for row in read_metrics(run_dir):
        for layer, health in ((row.get("moe") or {}).get("layers") or {}).items():
            shares = health.get("share") if isinstance(health, dict) else None
            if not shares:  # a row this reader does not know: the report is no place to fail
                continue
            total = sums.setdefault(int(layer), [0.0] * len(shares))
            if len(total) != len(shares):  # another expert count (a changed recipe): not this map's
                continue
            sums[int(layer)] = [a + b for a, b in zip(total, shares)]
            counts[int(layer)] = counts.get(int(layer), 0) + 1
    return {layer: [s / counts[layer] for s in sums[layer]] for layer in sorted(sums) if counts.get(layer)}


def plot_expert_load(run_dir: str | Path, path: str | Path, title: str = "") -> Path | None:
    """The heat map of ``stage_expert_load`` as a PNG at ``path``; None when the stage has no MoE
    rows (dense model, or nothing logged yet)."""
    load = stage_expert_load(run_dir)
    if not load:
        return None
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    layers = sorted(load)
    experts = max(len(shares) for shares in load.values())
    share = np.array([load[layer] + [np.nan] * (experts - len(load[layer])) for layer in layers])  # [L, E]
    relative = share * experts  # 1.0 = balanced
    figure = Figure(figsize=(min(3 + 0.45 * experts, 16), min(1.8 + 0.45 * len(layers), 12)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    worst = float(np.nanmax(relative))
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, worst))  # two slopes: 0..1 and 1..worst
    image = axes.imshow(relative, aspect="auto", cmap="coolwarm", norm=norm, interpolation="nearest")
    figure.colorbar(image, ax=axes, label="load / balanced")  # share x experts; short: fits one layer
    if experts <= 16:  # the numbers themselves where they fit
        for row, col in np.ndindex(share.shape):
            if not np.isnan(share[row, col]):
                shade = norm(relative[row, col])  # white on the dark ends of the scale, black between
                axes.text(col, row, f"{100 * share[row, col]:.0f}%", ha="center", va="center", fontsize=7,
                          color="white" if shade < 0.15 or shade > 0.85 else "black")
    axes.set_xticks(range(0, experts, max(1, experts // 16)))  # at most ~16 labels: 64 experts stay legible
    axes.set_xlabel("expert")
    axes.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    axes.set_title(f"{title or 'expert load'}\nshare of the routed slots (balanced {100 / experts:.1f}%, "
                   f"max/mean {worst:.2f})", fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
