"""The layout of an attempt on fewer (or more) nodes: ``reliability.on_node_loss: shrink``.

    layout = layout_for("cfg.yaml", nodes=[0, 2], nproc_per_node=1)   # world 2, dp 2, accumulation ...

One rule for every launcher that goes on without a node (the flow's ``tasks/elastic.py`` after a
failed self-check, the hosts launcher ``reliability/host_watch.py`` after a lost host): the world
is the surviving nodes' ranks, the data-parallel size shrinks with it, gradient accumulation grows
so the global batch stays what the config says, and the ranks restore the newest committed
checkpoint resharded to the new layout, its data position re-split over the new DP ranks
(``checkpoint/reshard.py``). A split the config cannot make (a global batch the new DP size does
not divide) is refused here, by ``load_config``, before any rank starts.

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import load_config


@dataclass
class Layout:
    nodes: list[int]
    world_size: int
    dp: int
    accumulation: int

    def overrides(self) -> list[str]:
        """What the attempt's ranks are told: the world size they must find (checked at start)."""
        return [f"parallel.world_size={self.world_size}"]


def layout_for(config_path: str, nodes: list[int], nproc_per_node: int, overrides: list[str] | None = None) -> Layout:
    world = len(nodes) * nproc_per_node
    run = load_config(config_path, [*(overrides or []), f"parallel.world_size={world}"])
    dp = run.parallel.data_parallel_size(world)
    return Layout(list(nodes), world, dp, run.train.grad_accumulation_steps(dp))


def change(previous: list[int] | None, nodes: list[int]) -> str | None:
    """"shrink" / "grow" / None between two attempts' node lists."""
    if previous is None or previous == nodes:
        return None
    return "shrink" if len(nodes) < len(previous) else "grow"
