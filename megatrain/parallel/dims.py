"""The 3D layout (dp, tp, pp) and its process groups, passed around as one object.

Rank order: tensor parallel innermost (consecutive ranks share a node), then data parallel, then
pipeline:  rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank.  DP groups are therefore built
from nearby ranks, as MegaScale does (it builds DP groups before PP groups for locality).
DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model) orders ranks the same way,
so its pipeline groups and ours contain the same ranks (``megatrain.parallel.deepspeed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def validate(self, world_size: int, gpus_per_node: int, n_head: int, n_layer: int) -> None:
        """Fail before any group exists when the layout cannot work: wrong world size, a TP group
        that would straddle two nodes (its all-gathers and reduce-scatters run on every layer and
        need NVLink), or a model that cannot be split that way."""
        if min(self.dp, self.tp, self.pp) < 1:
            raise ValueError(f"dp, tp and pp must be >= 1, got dp={self.dp} tp={self.tp} pp={self.pp}")
        if self.world_size != world_size:
            raise ValueError(f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} != world size {world_size}")
        # TP groups are runs of tp consecutive ranks; when tp divides the node size, no run straddles two nodes.
        if self.tp > gpus_per_node or gpus_per_node % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide gpus_per_node ({gpus_per_node}): TP never crosses a node")
        if world_size > gpus_per_node and world_size % gpus_per_node:
            raise ValueError(
                f"world size {world_size} spans several nodes but is not a multiple of gpus_per_node ({gpus_per_node})"
            )
        if n_head % self.tp:
            raise ValueError(f"tp ({self.tp}) must divide n_head ({n_head})")
        if self.pp > n_layer:
            raise ValueError(f"pp ({self.pp}) must not exceed n_layer ({n_layer})")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (pp_rank, dp_rank, tp_rank)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def stage_groups(self) -> list[list[int]]:
        """All ranks of one pipeline stage (its TP x DP ranks): the group over which a per-tensor
        norm of a TP-sharded, ZeRO-partitioned tensor is summed (LAMB's trust ratio)."""
        return [[self.rank_of(p, d, t) for d in range(self.dp) for t in range(self.tp)] for p in range(self.pp)]


@dataclass
class ProcessGroups:
    """This rank's view of the layout: its coordinates and the groups it belongs to."""

    dims: ParallelDims
    rank: int
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    stage_group: dist.ProcessGroup | None = None
    coords: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.coords = self.dims.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]


def build_process_groups(dims: ParallelDims, rank: int) -> ProcessGroups:
    """Create every TP, DP, PP and stage group (all ranks must call ``new_group`` for each, in
    order) and keep the ones this rank belongs to."""
    groups = ProcessGroups(dims=dims, rank=rank)
    layouts = (
        ("tp_group", dims.tp_groups()), ("dp_group", dims.dp_groups()), ("pp_group", dims.pp_groups()),
        ("stage_group", dims.stage_groups()),
    )
    for attr, ranks_list in layouts:
        for ranks in ranks_list:
            group = dist.new_group(ranks) if dist.is_initialized() else None
            if rank in ranks:
                setattr(groups, attr, group)
    return groups
