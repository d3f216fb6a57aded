"""The store traffic of megatrain's start-up, one rank at a time, as a program of store
operations (benchmarks/init.py records the real thing with gloo and replays this at scale).

A rank's start-up, as ``megatrain/parallel/init.py`` and ``dims.build_process_groups`` run it:

  join barrier       compare_set(join/rank<r>), add(join/count), the last arrival sets join/done,
                     wait(join/done)                                   (rendezvous.join)
  world group        gloo: set its address, then get every member's (a full mesh, O(n) per rank);
                     NCCL: group rank 0 sets the ncclUniqueId, every other rank gets it
  layout groups      the same per group this rank is in (TP, DP, PP, stage; ordered mode creates
                     a member set once); with eager NCCL (a device bound at init) the groups are
                     split from the world communicator (ncclCommSplit) and cost no store traffic
  barrier mode only  after every group of the layout, on every rank: torch's store barrier
                     (add 1, add 0, the rank that counts n sets last_worker, wait last_worker)

Ops are tuples: ("set"|"get"|"add"|"compare_set"|"wait", key) plus ("barrier", key, n) for
"add 1; the n-th arrival sets key/done; wait key/done" (the join barrier) and ("store_barrier",
key, n) for torch's variant. ``count_ops`` expands both to what a ``CountingStore`` would record.
Gloo's traffic is checked against recordings of real runs (``tests/benchmarks/test_init.py``);
NCCL's is modelled on ProcessGroupNCCL's unique-id broadcast (no multi-GPU host here to record).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megatrain.parallel.dims import ParallelDims


def layout_groups(dims: ParallelDims) -> list[list[int]]:
    """All groups in the global creation order (dims.build_process_groups)."""
    return [*dims.tp_groups(), *dims.dp_groups(), *dims.pp_groups(), *dims.stage_groups()]


def _connect(group_name: str, ranks: Sequence[int], rank: int, backend: str) -> list[tuple]:
    """One communicator's rendezvous, as seen by one of its members."""
    index = ranks.index(rank)
    if backend == "gloo":  # every member publishes its address and reads everyone's
        return [("set", f"{group_name}/{index}"), *(("get", f"{group_name}/{i}") for i in range(len(ranks)))]
    if index == 0:  # NCCL: the root publishes the unique id, the others fetch it
        return [("set", f"{group_name}/nccl_id")]
    return [("get", f"{group_name}/nccl_id")]


def own_groups(rank: int, dims: ParallelDims) -> list[tuple[int, list[int]]]:
    """(index in ``layout_groups`` order, members) of the four groups ``rank`` belongs to,
    computed from its coordinates (no scan over every group: 12,288 ranks x 3,144 groups)."""
    p, d, t = dims.coords(rank)
    n_tp, n_dp, n_pp = dims.pp * dims.dp, dims.pp * dims.tp, dims.dp * dims.tp
    return [
        (p * dims.dp + d, [dims.rank_of(p, d, i) for i in range(dims.tp)]),
        (n_tp + p * dims.tp + t, [dims.rank_of(p, i, t) for i in range(dims.dp)]),
        (n_tp + n_dp + d * dims.tp + t, [dims.rank_of(i, d, t) for i in range(dims.pp)]),
        (n_tp + n_dp + n_pp + p, [dims.rank_of(p, i, j) for i in range(dims.dp) for j in range(dims.tp)]),
    ]


def rank_phases(rank: int, dims: ParallelDims, backend: str = "nccl", mode: str = "ordered",
                eager: bool = True) -> dict[str, list[tuple]]:
    """The store operations of one rank's start-up, by phase (as ``StartupTimer`` names them)."""
    world = dims.world_size
    phases = {
        "rendezvous": [("compare_set", f"join/rank{rank}"), ("barrier", "join", world)],
        "world_group": _connect("world", range(world), rank, backend),  # a range: O(1) index
        "layout_groups": [],
    }
    split = backend == "nccl" and eager  # subgroups by ncclCommSplit: no store traffic
    mine = dict(own_groups(rank, dims))
    n_groups = dims.pp * dims.dp + dims.pp * dims.tp + dims.dp * dims.tp + dims.pp
    seen: set[tuple[int, ...]] = set()  # ordered mode creates a member set once (only ours can repeat)
    for g in (range(n_groups) if mode == "barrier" else sorted(mine)):  # barriers: every group, every rank
        if g in mine and not split and not (mode == "ordered" and tuple(mine[g]) in seen):
            phases["layout_groups"] += _connect(f"g{g}", mine[g], rank, backend)
        if g in mine:
            seen.add(tuple(mine[g]))
        if mode == "barrier":
            phases["layout_groups"].append(("store_barrier", f"store_based_barrier_key:g{g}", world))
    return phases


def rank_program(rank: int, dims: ParallelDims, backend: str = "nccl", mode: str = "ordered",
                 eager: bool = True) -> list[tuple]:
    """The store operations of one rank's start-up, in order."""
    return [op for ops in rank_phases(rank, dims, backend, mode, eager).values() for op in ops]


def count_ops(program: list[tuple], last: bool = False) -> Counter:
    """What a CountingStore records for ``program`` (``last``: this rank arrives last at every
    barrier, so it also does the barrier's set)."""
    counts: Counter = Counter()
    for op in program:
        if op[0] == "barrier":
            counts.update(add=1, wait=1, set=int(last))
        elif op[0] == "store_barrier":
            counts.update(add=2, wait=1, set=int(last))
        elif op[0] == "get":
            counts.update(get=1, wait=1)  # c10d's get waits for the key first
        else:
            counts[op[0]] += 1
    return counts


def total_ops(dims: ParallelDims, backend: str = "nccl", mode: str = "ordered", eager: bool = True) -> int:
    """Store operations of the whole world's start-up (one last arrival per barrier)."""
    total = sum(sum(count_ops(rank_program(r, dims, backend, mode, eager)).values()) for r in range(dims.world_size))
    barriers = sum(1 for op in rank_program(0, dims, backend, mode, eager) if op[0] in ("barrier", "store_barrier"))
    return total + barriers  # each barrier's one release set
