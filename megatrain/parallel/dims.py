"""The layout (dp, cp, tp, pp, and ep inside dp) and its process groups, passed around as one object.

Context parallelism (``cp``) splits each sample's tokens over cp ranks (``context_parallel.py``).
Its ranks hold the same parameters and see the same samples, so their gradients are reduced with
the data-parallel ones: the *replica* group of a rank is its dp x cp ranks (ZeRO partitions over
it). ``ProcessGroups.replicas()`` is the layout as ZeRO, DeepSpeed and the checkpoint see it: dp'
= dp * cp replicas, no cp; the data loader and the attention see the real dp and cp.

Expert parallelism (``ep``) is carved out of the replicas (dp x cp ranks), as Megatron-Core and
torchtitan do: each run of ``ep`` consecutive replica indices is an EP group (its ranks hold
different experts and exchange tokens by all-to-all); the ranks at the same position of every EP
group form an expert-data-parallel (EDP) group, over which those experts' gradients are reduced.
Non-expert parameters stay replicated over the whole replica group. With cp = 1 the replicas are
the DP ranks; with cp > 1 an EP group can be a sample's cp ranks (routing is per token, so which
rank holds a token does not matter to the experts). ``ep=1``: no EP groups are created.

Rank order: tensor parallel innermost (consecutive ranks share a node), then context parallel,
then data parallel, then pipeline (Megatron's order):
rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank; with cp = 1 the
3D order  rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank. The replica index of a rank,
dp_rank * cp + cp_rank, is then its dp coordinate in the replica layout. DP groups are therefore built
from nearby ranks, as MegaScale does (it builds DP groups before PP groups for locality).
DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model) orders ranks the same way,
so its pipeline groups and ours contain the same ranks (``megatrain.parallel.deepspeed``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    ep: int = 1  # expert-parallel degree, a divisor of dp * cp (see the module docstring)
    cp: int = 1  # context-parallel degree (see the module docstring)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def replicas(self) -> ParallelDims:
        """The layout as ZeRO sees it: dp * cp replicas of the (pp, tp) shards, no cp."""
        return ParallelDims(dp=self.dp * self.cp, tp=self.tp, pp=self.pp, ep=self.ep)

    def validate(self, world_size: int, gpus_per_node: int, n_head: int, n_layer: int) -> None:
        """Fail before any group exists when the layout cannot work: wrong world size, a TP group
        that would straddle two nodes (its all-gathers and reduce-scatters run on every layer and
        need NVLink), or a model that cannot be split that way."""
        if min(self.dp, self.cp, self.tp, self.pp) < 1:
            raise ValueError(f"dp, cp, tp and pp must be >= 1, got dp={self.dp} cp={self.cp} tp={self.tp} pp={self.pp}")
        if self.world_size != world_size:
            raise ValueError(f"tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.world_size} "
                             f"!= world size {world_size}")
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
        if self.ep < 1 or (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp * cp ({self.dp} * {self.cp}): EP groups are carved out "
                             "of the replicas")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (pp_rank, dp_rank, tp_rank) (the cp coordinate: ``cp_rank``)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _rest(self) -> list[tuple[int, int]]:
        return [(p, c) for p in range(self.pp) for c in range(self.cp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t, c) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def dp_groups(self) -> list[list[int]]:
        """The data-parallel ranks: different samples, same cp, tp, pp coordinates."""
        return [[self.rank_of(p, d, t, c) for d in range(self.dp)] for p, c in self._rest() for t in range(self.tp)]

    def cp_groups(self) -> list[list[int]]:
        """The ranks sharing one sample's tokens (tp ranks apart: the ring's neighbours)."""
        return [[self.rank_of(p, d, t, c) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def replica_groups(self) -> list[list[int]]:
        """dp x cp ranks holding the same parameters, in rank order: gradients are reduced over them."""
        return [[self.rank_of(p, d, t, c) for d in range(self.dp) for c in range(self.cp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t, c) for p in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """Runs of ``ep`` consecutive replica indices (nearby ranks: the all-to-all stays within a node)."""
        if self.cp > 1:  # the replica layout numbers the ranks the same way, replica index as its dp
            return self.replicas().ep_groups()
        return [[self.rank_of(p, d0 + e, t) for e in range(self.ep)]
                for p in range(self.pp) for t in range(self.tp) for d0 in range(0, self.dp, self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """The replicas holding the same experts: position e of every EP group."""
        if self.cp > 1:
            return self.replicas().edp_groups()
        return [[self.rank_of(p, d, t) for d in range(e, self.dp, self.ep)]
                for p in range(self.pp) for t in range(self.tp) for e in range(self.ep)]

    def stage_groups(self) -> list[list[int]]:
        """All ranks of one pipeline stage (its TP x CP x DP ranks): the group over which a per-tensor
        norm of a TP-sharded, ZeRO-partitioned tensor is summed (LAMB's trust ratio)."""
        return [[self.rank_of(p, d, t, c) for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]
                for p in range(self.pp)]


@dataclass
class ProcessGroups:
    """This rank's view of the layout: its coordinates and the groups it belongs to."""

    dims: ParallelDims
    rank: int
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    stage_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # ep > 1 only
    edp_group: dist.ProcessGroup | None = None  # ep > 1 only
    cp_group: dist.ProcessGroup | None = None  # cp > 1 only
    replica_group: dist.ProcessGroup | None = None  # cp > 1 only (else the dp group): dp x cp ranks
    coords: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.coords = self.dims.coords(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank(self.rank)

    def replicas(self) -> ProcessGroups:
        """This rank in the replica layout (dp * cp data-parallel ranks, no cp): what DeepSpeed's
        ZeRO, the gradient reduction and the checkpoint's files see. Itself when cp = 1."""
        if self.dims.cp == 1:
            return self
        return ProcessGroups(dims=self.dims.replicas(), rank=self.rank, tp_group=self.tp_group,
                             dp_group=self.replica_group, pp_group=self.pp_group, stage_group=self.stage_group,
                             ep_group=self.ep_group, edp_group=self.edp_group)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def ep_rank(self) -> int:
        """Which slice of the experts this rank holds (0 .. ep - 1): its replica index mod ep."""
        return self.dims.replicas().coords(self.rank)[1] % self.dims.ep


def _layouts(dims: ParallelDims) -> tuple[tuple[str, list[list[int]]], ...]:
    """Every group of the layout, in the one global order all ranks follow."""
    layouts = (
        ("tp_group", dims.tp_groups()), ("dp_group", dims.dp_groups()), ("pp_group", dims.pp_groups()),
        ("stage_group", dims.stage_groups()),
    )
    if dims.ep > 1:
        layouts += (("ep_group", dims.ep_groups()), ("edp_group", dims.edp_groups()))
    if dims.cp > 1:
        layouts += (("cp_group", dims.cp_groups()), ("replica_group", dims.replica_groups()))
    return layouts


def build_process_groups(dims: ParallelDims, rank: int, mode: str = "ordered") -> ProcessGroups:
    """Create the TP, DP, PP and stage groups (and CP, replica, EP, EDP when used) and keep the
    ones this rank belongs to.

    ``mode`` (``parallel.init.groups``):
    - ``ordered``: one pass over the layout in a fixed global order; each rank creates only the
      four groups it belongs to, synchronising with their members only
      (``use_local_synchronization``). Every rank following the same order is what makes this
      deadlock-free: a rank waits in a group only for ranks that reach it after groups earlier in
      the order. O(1) groups and O(group size) store traffic per rank. On NCCL with a device bound
      at init (``eager_nccl``), groups come from ``ncclCommSplit``, which every rank of the parent
      must call, so this mode then falls back to ``default``'s calls (still without barriers).
    - ``default``: every rank calls ``new_group`` for every group (torch's contract; non-members
      return at once).
    - ``barrier``: ``default`` plus a global store-based barrier after each group - what PyTorch
      did before 2.1 (``TORCH_DIST_INIT_BARRIER=1``): O(world) groups x O(world) ranks, the O(n^2)
      MegaScale measured. Kept to benchmark against.
    """
    groups = ProcessGroups(dims=dims, rank=rank)
    if not dist.is_initialized():
        return groups
    if mode not in ("ordered", "default", "barrier"):
        raise ValueError(f"parallel.init.groups: {mode!r} is not one of ordered, default, barrier")
    split = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    local = mode == "ordered" and not split
    previous = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1" if mode == "barrier" else "0"
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}  # ordered: one communicator per member set
    try:
        for attr, ranks_list in _layouts(dims):
            for ranks in ranks_list:
                if local and rank not in ranks:
                    continue
                if local and tuple(ranks) in made:  # e.g. dp == stage group when tp = pp = 1 (same hashed name)
                    group = made[tuple(ranks)]
                else:
                    group = made[tuple(ranks)] = dist.new_group(ranks, use_local_synchronization=local)
                if rank in ranks:
                    setattr(groups, attr, group)
    finally:
        if previous is None:
            del os.environ["TORCH_DIST_INIT_BARRIER"]
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = previous
    return groups
