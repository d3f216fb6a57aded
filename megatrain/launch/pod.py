"""One cluster node's ranks, started without torchrun, so that no unauthenticated store listens.

    python -m megatrain.launch.pod --nnodes N --nproc-per-node M --node-rank I --master-addr HOST
                                   [--master-port P] [--script FILE | --module MOD] [ARGS...]

torchrun's agent on node 0 hosts a ``TCPStore`` for the other agents and the ranks, reachable by
every pod of the cluster network and without any authentication. On a cluster (``launcher:
kubernetes``) the ranks meet in the campaign's Redis instead, which requires a password
(``config/campaign.py`` sets ``parallel.init.store=redis`` for them; the keys live under the run
token's digest), so no agent is needed: this process starts the node's M ranks itself with the
environment torchrun would give them (global rank I*M + local rank; ``MASTER_ADDR:MASTER_PORT``
only name the rendezvous, nothing listens there) and supervises them as torchrun does: the first
rank to fail stops the others, and this process exits with its code (0 when every rank finished).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading

from megatrain.launch.ranks import _pump, die_with_parent
from megatrain.launch.standby import RankGroup, rank_lines

POLL_S = 0.2


def pod_rank_env(node: int, nnodes: int, nproc: int, local: int, master_addr: str, master_port: int) -> dict[str, str]:
    """What torchrun sets for local rank ``local`` of node ``node`` (megatrain.parallel.init reads it)."""
    return {"RANK": str(node * nproc + local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(nnodes * nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node), "ROLE_RANK": str(node * nproc + local),
            "ROLE_WORLD_SIZE": str(nnodes * nproc), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0"}


def run_pod(nnodes: int, nproc: int, node: int, master_addr: str, master_port: int, program: list[str]) -> int:
    """Start the node's ranks of ``python PROGRAM``, supervise them, return the first failure's code."""
    tail: collections.deque = collections.deque(maxlen=400)
    procs, tails, pumps = [], [], []
    for local in range(nproc):
        env = {**os.environ, **pod_rank_env(node, nnodes, nproc, local, master_addr, master_port)}
        proc = subprocess.Popen([sys.executable, *program], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True, preexec_fn=die_with_parent)
        rank = node * nproc + local
        tails.append(collections.deque(maxlen=400))
        write = rank_lines(tails[-1], tail, lambda line, rank=rank: print(f"[rank{rank}]: {line}", flush=True))
        pumps.append(threading.Thread(target=_pump, args=(proc.stdout, write), daemon=True))
        pumps[-1].start()
        procs.append(proc)
    group = RankGroup(procs, tails, pumps)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())  # the pod is deleted: stop the ranks, then go
    try:
        while group.wait(POLL_S) is None:
            if stopped.is_set():
                group.stop()
                return 128 + signal.SIGTERM
    finally:
        group.stop(grace_s=0.0)
    failure = group.first_failure
    if failure is not None:
        print(f"[pod] rank {failure['rank'] + node * nproc} exited with code {failure['exitcode']}"
              + (f": {failure['error']}" if failure.get("error") else ""), flush=True)
        code = failure["exitcode"]
        return code if code > 0 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatrain.launch.pod", description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True, help="names the rendezvous (its keys); nothing listens there")
    parser.add_argument("--master-port", type=int, default=29500)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--module", default="megatrain.train", help="what each rank runs (default megatrain.train)")
    what.add_argument("--script", help="a file each rank runs in place of the module")
    args, rest = parser.parse_known_args(argv)
    program = [args.script, *rest] if args.script else ["-m", args.module, *rest]
    return run_pod(args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port, program)


if __name__ == "__main__":
    sys.exit(main())
