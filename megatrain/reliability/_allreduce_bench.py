"""One rank of the self-check's intra-node all-reduce test (``selfcheck.allreduce_busbw_gbs``
starts one process per local GPU, or two on CPU).

A plain module run with ``python -m`` rather than a multiprocessing target: spawn would
re-import the caller's ``__main__`` (a Prefect worker, pytest), which is slow and fragile.

    python -m megatrain.reliability._allreduce_bench RANK WORLD STORE_FILE NBYTES RESULT_FILE
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist


def main(argv: list[str]) -> None:
    rank, world, store_path, nbytes, result_path = int(argv[0]), int(argv[1]), argv[2], int(argv[3]), argv[4]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the ranks share the node's cores
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    try:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def timed(calls: int) -> float:
            """Seconds for ``calls`` back-to-back all-reduces, one synchronisation at the end: a
            sync (or a control message) after every call would add its latency to each, which cost
            a quarter of the bus bandwidth of a 256 MB all-reduce between two H200s."""
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        timed(2)  # warm-up: connections, buffers
        # Every rank must make the same number of calls: rank 0 sizes the run to ~0.3 s from a
        # short probe and tells the others.
        probe = timed(3) / 3
        calls = torch.tensor([max(5, min(200, int(0.3 / max(probe, 1e-6))))], device=device)
        dist.broadcast(calls, src=0)
        calls = int(calls.item())
        dist.all_reduce(torch.zeros(1, device=device))  # start together (a barrier without its warning)
        seconds = timed(calls)
        seconds = torch.tensor([seconds / calls], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        if rank == 0:
            with open(result_path, "w") as handle:
                json.dump({"seconds_per_call": seconds.item(), "calls": calls}, handle)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
