"""Start-up benchmark: how process-group initialisation grows with the number of ranks.

    python benchmarks/init.py [--ranks 8,16,32] [--sim 512,2048,4096,12288] [--sim-barrier 64,128,256]
                              [--out runs/init]

Real (measured): N gloo CPU processes on this machine run megatrain's own start-up functions
(``parallel.init.connect_store``, ``rendezvous.join``, ``init_process_group``,
``dims.build_process_groups``) with the TCPStore and with Redis, layout tp=2 x pp=2 x dp=N/4,
creating the layout's groups three ways in one world: ``default`` (every rank calls new_group
for every group), ``barrier`` (plus torch's global store barrier after each group: pre-2.1
PyTorch, MegaScale's O(n^2)) and ``ordered`` (each rank only its own groups, group-local
synchronisation; megatrain's default). Prints the slowest rank's seconds per phase and the store
operations per rank, recorded by a counting store; and checks that the traffic model of
``init_traffic.py`` predicts those recorded counts exactly.

Simulated (replayed): that traffic model, for the GPU path (NCCL: unique-id exchange, eager
init with ncclCommSplit), replayed for thousands of ranks by asyncio clients (one connection per
simulated rank, the real client's requests) against a real redis-server and a real libuv
TCPStore server (``init_sim.py``). The measured number is the server's CPU time; wall time is
printed too but includes this process's Python clients. Limits: one machine's loopback (no
network latency, no 12,288 real processes, no NCCL communicator set-up itself - only the store
traffic that MegaScale found dominant), and 2 CPU cores shared with other work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from init_traffic import count_ops, rank_phases, total_ops  # noqa: E402

from megatrain.parallel.dims import ParallelDims  # noqa: E402

MODES = ("default", "barrier", "ordered")
LIMITS = ("method: real = N gloo processes on this machine's loopback; sim = megatrain's NCCL-path store "
          "traffic replayed by asyncio clients against a real redis-server and a real libuv TCPStore; "
          "'server s' is the server process's CPU time; 2 shared CPU cores (other engineers' jobs run too)")


def worker(store_kind: str, redis_url: str | None) -> int:
    """One real rank: time megatrain's start-up phases and count its store operations."""
    import datetime

    import torch.distributed as dist

    from megatrain.config import InitConfig
    from megatrain.parallel.dims import build_process_groups
    from megatrain.parallel.init import connect_store
    from megatrain.parallel.rendezvous import join

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=300)
    out: dict = {"rank": rank, "s": {}, "ops": {}}

    def phase(name: str, fn):
        before = Counter(store.ops) if "store" in locals_ else Counter()
        start = time.perf_counter()
        result = fn()
        out["s"][name] = time.perf_counter() - start
        out["ops"][name] = dict(Counter(locals_["store"].ops) - before)
        return result

    locals_: dict = {}
    start = time.perf_counter()
    store = locals_["store"] = connect_store(InitConfig(store=store_kind, redis_url=redis_url), rank, world,
                                             os.environ["RUN_ID"], None, timeout)
    out["s"]["store_connect"] = time.perf_counter() - start
    phase("rendezvous", lambda: join(store, rank, world, 300))
    phase("world_group", lambda: dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                                         timeout=timeout))
    dims = ParallelDims(dp=world // 4, tp=2, pp=2)
    for mode in MODES:
        dist.barrier()  # modes do not overlap
        phase(f"groups_{mode}", lambda: build_process_groups(dims, rank, mode))
    dist.barrier()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_real(n: int, store_kind: str, redis_url: str | None) -> dict:
    port, run_id = free_port(), f"bench-{store_kind}-{n}-{time.time_ns()}"
    from init_sim import _server_env  # rank 0 hosts the TCPStore: the same resolver workaround

    env = {**os.environ, "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RUN_ID": run_id, "OMP_NUM_THREADS": "1", **_server_env()}
    command = [sys.executable, __file__, "--worker", store_kind, "--redis-url", redis_url or ""]
    start = time.perf_counter()
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    wall = time.perf_counter() - start
    rows = []
    for proc, out in zip(procs, outs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"rank failed ({proc.returncode}):\n{out[-2000:]}")
        rows.append(json.loads(lines[0][len("RESULT "):]))
    return {"ranks": n, "store": store_kind, "launch_to_done_s": wall, "rows": rows}


def model_matches(result: dict) -> bool:
    """Do the recorded counts equal init_traffic's model, op by op, for every rank and phase?
    (A barrier's release ``set`` is done by whichever ranks count n: not compared.)"""
    n = result["ranks"]
    dims = ParallelDims(dp=n // 4, tp=2, pp=2)
    for row in result["rows"]:
        for mode in MODES:
            model = rank_phases(row["rank"], dims, "gloo", mode)
            for phase, recorded in (("rendezvous", row["ops"]["rendezvous"]), ("world_group", row["ops"]["world_group"]),
                                    ("layout_groups", row["ops"][f"groups_{mode}"])):
                want = count_ops(model[phase])
                got = Counter(recorded)
                if any(got[k] != want[k] for k in ("get", "wait", "add", "compare_set")):
                    print(f"  model mismatch rank {row['rank']} {mode} {phase}: recorded {dict(got)} model {dict(want)}")
                    return False
    return True


def print_real(results: list[dict]) -> None:
    print(f"\nREAL: {LIMITS}")
    print(f"{'ranks':>5} {'store':>5} {'connect':>8} {'rendezv':>8} {'world':>8} {'default':>8} {'barrier':>8} "
          f"{'ordered':>8} {'launch->done':>12} {'ops/rank (ordered path)':>24} {'barrier ops/rank':>16} model")
    for r in results:
        slowest = {k: max(row["s"][k] for row in r["rows"]) for k in r["rows"][0]["s"]}
        path = ("rendezvous", "world_group", "groups_ordered")
        ops = sum(sum(row["ops"][k].values()) for row in r["rows"] for k in path) / r["ranks"]
        barrier_ops = sum(sum(row["ops"]["groups_barrier"].values()) for row in r["rows"]) / r["ranks"]
        print(f"{r['ranks']:>5} {r['store']:>5} {slowest['store_connect']:>8.3f} {slowest['rendezvous']:>8.3f} "
              f"{slowest['world_group']:>8.3f} {slowest['groups_default']:>8.3f} {slowest['groups_barrier']:>8.3f} "
              f"{slowest['groups_ordered']:>8.3f} {r['launch_to_done_s']:>12.1f} {ops:>24.1f} {barrier_ops:>16.1f} "
              f"{'ok' if r['model_ok'] else 'MISMATCH'}")
    print("  (seconds: the slowest rank per phase; launch->done includes each process importing torch)")


def start_servers(n: int) -> tuple:
    from init_sim import raise_fd_limit, start_redis, start_tcpstore_server

    raise_fd_limit(n + 512)
    redis, redis_port = start_redis(n)
    tcp = start_tcpstore_server()
    return redis, redis_port, tcp, tcp.port


def run_sim(n: int, mode: str, eager: bool) -> list[dict]:
    from init_sim import replay

    tp, pp = (8, 8) if n >= 64 * 2 else (2, 2)
    dims = ParallelDims(dp=n // (tp * pp), tp=tp, pp=pp)
    programs = [[op for ops in rank_phases(r, dims, "nccl", mode, eager).values() for op in ops] for r in range(n)]
    redis, redis_port, tcp, tcp_port = start_servers(n)
    rows = []
    try:
        for kind, port, pid in (("redis", redis_port, redis.pid), ("tcp", tcp_port, tcp.pid)):
            result = replay(kind, port, pid, programs, f"sim:{mode}:{n}:")
            rows.append({"ranks": n, "layout": f"tp{tp} pp{pp} dp{dims.dp}", "mode": mode, "eager": eager,
                         "store": kind, "model_ops": total_ops(dims, "nccl", mode, eager), **result})
    finally:
        redis.kill()
        tcp.kill()
    return rows


def growth(rows: list[dict]) -> str:
    """Exponent k of server_s ~ n^k (least squares in log-log); 1 = linear, 2 = quadratic."""
    pts = [(math.log(r["ranks"]), math.log(max(r["server_cpu_s"], 1e-3))) for r in rows]
    ops = [(math.log(r["ranks"]), math.log(r["ops"])) for r in rows]

    def slope(p):
        mx, my = sum(x for x, _ in p) / len(p), sum(y for _, y in p) / len(p)
        return sum((x - mx) * (y - my) for x, y in p) / max(1e-9, sum((x - mx) ** 2 for x, _ in p))

    return f"ops ~ n^{slope(ops):.2f}, server time ~ n^{slope(pts):.2f}" if len(rows) > 1 else "-"


def print_sim(rows: list[dict]) -> None:
    print(f"\nSIMULATED: {LIMITS}")
    print(f"{'ranks':>6} {'layout':>16} {'mode':>8} {'eager':>5} {'store':>5} {'ops':>10} {'ops/rank':>8} "
          f"{'requests':>10} {'server s':>9} {'wall s':>8}")
    for r in rows:
        print(f"{r['ranks']:>6} {r['layout']:>16} {r['mode']:>8} {str(r['eager']):>5} {r['store']:>5} {r['ops']:>10} "
              f"{r['ops'] / r['ranks']:>8.1f} {r['requests']:>10} {r['server_cpu_s']:>9.2f} {r['wall_s']:>8.2f}")
    for key in sorted({(r["mode"], r["eager"], r["store"]) for r in rows}):
        group = [r for r in rows if (r["mode"], r["eager"], r["store"]) == key]
        print(f"  growth {key[0]:>8} eager={key[1]!s:<5} {key[2]:>5}: {growth(group)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,16,32", help="real runs: world sizes (multiples of 4)")
    parser.add_argument("--stores", default="tcp,redis")
    parser.add_argument("--sim", default="512,2048,4096,12288", help="simulated world sizes, megatrain's path")
    parser.add_argument("--sim-barrier", default="64,128,256", help="simulated world sizes, the barrier mode")
    parser.add_argument("--out", default="runs/init")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.redis_url or None)

    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"limits": LIMITS, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()}
    real = []
    if args.ranks:
        from megatrain.reliability.redis_server import start_redis_server

        server = start_redis_server()  # a free port, taken again if another process wins it first
        redis_port = server.port
        try:
            for n in (int(x) for x in args.ranks.split(",")):
                for store_kind in args.stores.split(","):
                    result = run_real(n, store_kind, f"redis://127.0.0.1:{redis_port}/0")
                    result["model_ok"] = model_matches(result)
                    real.append(result)
                    print_real(real[-1:])
        finally:
            server.kill()
        print_real(real)
    sim = []
    for n in (int(x) for x in args.sim.split(",") if x):
        sim += run_sim(n, "ordered", eager=True) + run_sim(n, "ordered", eager=False)
    for n in (int(x) for x in args.sim_barrier.split(",") if x):
        sim += run_sim(n, "barrier", eager=False)
    if sim:
        print_sim(sim)
    report.update(real=real, sim=sim, load_avg_after=os.getloadavg())
    (out / "init.json").write_text(json.dumps(report, indent=1))
    print(f"\nload average {report['load_avg']} -> {report['load_avg_after']} on {os.cpu_count()} CPUs; wrote {out}/init.json")
    return 0 if all(r["model_ok"] for r in real) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
