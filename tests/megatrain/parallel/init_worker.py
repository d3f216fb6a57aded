"""One rank of the start-up tests: ``init_distributed`` with the given ``parallel.init`` fields
(JSON in argv[1]; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), then, for each
group-creation mode in argv[2] (comma-separated), the layout's groups and an all-reduce of
(rank + 1) over each of this rank's groups. Prints "JOINED" after the rendezvous and one line
"RESULT <json>" at the end: {mode: {group: sum}} and the store operations."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megatrain.config import InitConfig
from megatrain.parallel.dims import ParallelDims, build_process_groups
from megatrain.parallel.init import init_distributed, shutdown_distributed


def main() -> int:
    init = InitConfig(**json.loads(sys.argv[1]))
    modes = [m for m in sys.argv[2].split(",") if m]
    tp, pp = (int(x) for x in os.environ.get("LAYOUT", "1,1").split(","))
    env = init_distributed("cpu", "gloo", 60.0, init=init, run_id=os.environ.get("RUN_ID", "test"))
    print("JOINED", flush=True)
    dims = ParallelDims(dp=env.world_size // (tp * pp), tp=tp, pp=pp)
    sums: dict[str, dict[str, float]] = {}
    for mode in modes:
        groups = build_process_groups(dims, env.rank, mode)
        sums[mode] = {}
        for name in ("tp_group", "dp_group", "pp_group", "stage_group"):
            value = torch.tensor([float(env.rank + 1)])
            dist.all_reduce(value, group=getattr(groups, name))
            sums[mode][name] = value.item()
    print("RESULT " + json.dumps({"sums": sums, "store_ops": env.store.ops}), flush=True)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
