"""A multi-node stage on one machine: N torchrun launchers ("nodes") of M ranks each.

    python -m megatrain.launch.nodes --config CFG --nodes-dir DIR --nodes 0,1 --nproc-per-node 2 [k=v ...]

Each node is a real torchrun agent in its own process session, and the agents meet through a real
c10d rendezvous on loopback (node 0 hosts the store, listening on 127.0.0.1 only), as separate
machines would. Each node has
its own staging directory (``DIR/node-<i>/staging``: its ranks stage there and upload their own
files, like a cluster node's local disk; rank 0 commits) and its own node loader (one reader per
node: the node loader's channel is keyed by the agent's group rank). The node self-check runs per
node before an attempt (``tasks/elastic.py``).

This process supervises the agents: when one node's agent exits, the node is lost and the others
are stopped at once (their collectives would only wait for the missing peers until the timeout),
and it exits with the first failing node's code. ``megatrain.launch.ranks.run_ranks`` supervises this
process like a single torchrun (one session: one ``killpg`` stops every node).

Fault injection (``reliability.faults`` kind ``evict_node``): when rank 0's metrics reach the
fault's step, node ``fault.node`` is killed (SIGKILL of its whole session: agent and ranks) and
marked evicted for the rest of the stage (``<run_dir>/faults/evicted-node-<i>.json``), which its
self-check then reports as a failing check: a node that died and does not come back healthy.

Backends (``--backend``, chosen explicitly; ``loopback`` is the default and needs no root):

- ``loopback``: the agents are this machine's processes on 127.0.0.1, as above;
- ``hosts``: node ``i`` runs inside host ``node<i>`` of a cluster of ``megatrain/launch/hosts.py``
  (``--cluster NAME``), started there as a scheduler starts a pod: ``megatrain.launch.pod`` (the
  command the Kubernetes Job runs, ``tasks/kubernetes.py``), its ranks meeting in the cluster's
  Redis on the redis host (``parallel.init.store=redis``; no TCP store listens), gloo on the host's
  ``eth0``, the keepers' peer port on the host's address, and the node's staging on the host's own
  ``/tmp`` (a node's local disk: no other host sees it), and ``s3://`` URLs (``checkpoint.durable_url``
  ``s3://megatrain/<run>``) the storage host's S3 (``cluster_s3_env``). A cluster without Redis (``--no-services``)
  falls back to torchrun agents meeting through c10d at the first node's address.

  Each attempt on hosts gets a fencing epoch from the cluster's Redis (``launch/fencing.py``,
  ``MEGATRAIN_EPOCH`` in its ranks' environment; ``<run_dir>/epochs.jsonl``). A node the watch calls
  lost is not signalled when the attempt ends: a real launcher cannot reach a cut-off host, so its
  ranks live on until they fail by themselves, and the epoch keeps them from writing anything.

Engine code: imports neither prefect nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatrain.config import load_config
from megatrain.launch import hosts
from megatrain.launch.ranks import free_port, die_with_parent
from megatrain.launch.fencing import EPOCH_ENV, issue_epoch

BACKENDS = ("loopback", "hosts")
HOST_STAGING = "/tmp/megatrain/staging"  # inside a host: its private tmpfs, the node's local disk


def node_dir(nodes_dir: str | Path, node: int) -> Path:
    return Path(nodes_dir) / f"node-{node}"


def evicted_marker(run_dir: str | Path, node: int) -> Path:
    return Path(run_dir) / "faults" / f"evicted-node-{node}.json"


def nodes_command(config_path: str | Path, nodes: list[int], nproc_per_node: int, nodes_dir: str | Path,
                  overrides: list[str] | None = None, cluster: str | None = None, one_attempt: bool = False) -> list[str]:
    """The command ``run_ranks`` supervises for a stage on ``nodes`` (indices into the campaign's nodes);
    with ``cluster`` each node inside its host of that cluster (backend ``hosts``); ``one_attempt``: the
    watch ends the stage's attempt with a lost host's verdict and its caller plans the next (the flow)."""
    backend = ["--backend", "hosts", "--cluster", cluster, *(["--one-attempt"] if one_attempt else [])] if cluster else []
    module = "megatrain.reliability.host_watch" if cluster else "megatrain.launch.nodes"  # a lost host: by heartbeats
    return [sys.executable, "-m", module, "--config", str(config_path), "--nodes-dir", str(nodes_dir),
            "--nodes", ",".join(map(str, nodes)), "--nproc-per-node", str(nproc_per_node), *backend, *(overrides or [])]


def agent_command(config_path: str, nnodes: int, nproc_per_node: int, port: int, run_id: str, is_host: bool,
                  overrides: list[str], endpoint: str = "127.0.0.1", local: str = "127.0.0.1") -> list[str]:
    """One node's torchrun agent, joining the others through c10d on ``endpoint:port``; its stores
    listen on that address only (megatrain.launch.torchrun), its workers' on ``local``."""
    return [
        sys.executable, "-m", "megatrain.launch.torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{endpoint}:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={int(is_host)}", "--local-addr", local, "--max-restarts", "0",
        "-m", "megatrain.train", "--config", config_path, *overrides,
    ]


def pod_command(config_path: str, nnodes: int, nproc_per_node: int, position: int, master: str, port: int,
                overrides: list[str]) -> list[str]:
    """One node's ranks as the Kubernetes Job starts them (megatrain.launch.pod), meeting in Redis."""
    return [sys.executable, "-m", "megatrain.launch.pod", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(position), "--master-addr", master, "--master-port", str(port),
            "--config", config_path, *overrides]


def host_role(node: int) -> str:
    """The host of a cluster (megatrain/launch/hosts.py) that campaign node ``node`` runs on."""
    return f"node{node}"


def cluster_endpoints(cluster: hosts.Cluster) -> dict[str, str]:
    """The Redis and S3 URLs ``megatrain cluster up`` started, {} for a cluster without services."""
    path = hosts.STATE_DIR / f"{cluster.name}.endpoints.json"
    return json.loads(path.read_text()) if path.exists() else {}


def cluster_redis_password(cluster: hosts.Cluster) -> str:
    return (hosts.STATE_DIR / f"{cluster.name}.redis").read_text().strip()


def cluster_s3_env(cluster: hosts.Cluster) -> dict[str, str]:
    """The storage host's S3 endpoint and moto's test credentials, {} for a cluster without services."""
    from megatrain.launch.cluster_services import s3_env

    endpoint = cluster_endpoints(cluster).get("s3")
    return s3_env(endpoint) if endpoint else {}


def hosts_overrides(cluster_name: str) -> list[str]:
    """What a stage on the cluster's hosts adds to its config: as on Kubernetes the ranks meet in the
    password-protected Redis of the redis host, and their heartbeats and the keepers' peer registry go
    there too, not into a folder every host would have to share. None for a cluster without Redis."""
    endpoints = cluster_endpoints(hosts.Cluster.load(cluster_name))
    if "redis" not in endpoints:
        return []
    return ["parallel.init.store=redis", f"parallel.init.redis_url={endpoints['redis']}/0",
            f"reliability.redis_url={endpoints['redis']}/0"]


def _start_in_hosts(cluster_name: str, config_path: str, nodes: list[int], nproc_per_node: int, run_id: str,
                    overrides: list[str], extra_env: dict[str, str] | None = None) -> dict[int, subprocess.Popen]:
    """Each node's launcher inside its host; what reaches the other nodes goes over the bridge."""
    cluster = hosts.Cluster.load(cluster_name)
    missing = [host_role(n) for n in nodes if host_role(n) not in cluster.hosts]
    if missing:
        raise SystemExit(f"[launch_nodes] cluster {cluster_name} has no host {', '.join(missing)} "
                         f"(megatrain cluster up --hosts {max(nodes) + 1})")
    endpoints = cluster_endpoints(cluster)
    master = cluster.host(host_role(nodes[0])).address
    port = 29400 + int(run_id.rsplit("-", 1)[-1]) % 500  # the port a pod's ranks name; nothing listens when in Redis
    shared = list(overrides)
    agents: dict[int, subprocess.Popen] = {}
    for position, node in enumerate(nodes):
        role = host_role(node)
        address = cluster.host(role).address
        staging = f"{HOST_STAGING}/{run_id}/node-{node}"
        node_overrides = [*shared, f"checkpoint.staging_dir={staging}", "checkpoint.upload_mode=thread"]
        env = cluster.env(role, dict(os.environ, MEGATRAIN_NODE=str(node), MEGATRAIN_KEEPER_HOST=address,
                                     **(extra_env or {})))
        if "redis" in endpoints:
            env["MEGATRAIN_REDIS_PASSWORD"] = cluster_redis_password(cluster)
            argv = pod_command(config_path, len(nodes), nproc_per_node, position, master, port, node_overrides)
        else:
            argv = agent_command(config_path, len(nodes), nproc_per_node, port, run_id, position == 0, node_overrides,
                                 endpoint=master, local=address)
        agents[node] = subprocess.Popen(cluster.command(role, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent)
        threading.Thread(target=_pump, args=(node, agents[node].stdout), daemon=True).start()
    return agents


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().strip().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _pump(node: int, stream) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[node {node}] {line}")
        sys.stdout.flush()


def run_nodes(config_path: str, nodes: list[int], nproc_per_node: int, nodes_dir: str, overrides: list[str],
              backend: str = "loopback", cluster: str | None = None, watch=None) -> int:
    """``watch`` (backend hosts): called with (cfg, cluster, nodes) once, returns a function that
    gives a lost host's verdict or None (``megatrain.reliability.host_watch``): then an agent's exit
    is no evidence of a node's loss, only its report of its own ranks."""
    if backend == "hosts":
        # the cluster's Redis has its own password: one inherited from the launching shell (another
        # Redis's) would be refused there
        if (hosts.STATE_DIR / f"{cluster}.redis").exists():
            os.environ["MEGATRAIN_REDIS_PASSWORD"] = cluster_redis_password(hosts.Cluster.load(cluster))
        # a durable_url s3://... is the storage host's S3: the ranks (which inherit this environment)
        # upload, commit and restore over the bridge; an endpoint or keys of the launching shell would
        # name a store no host can reach
        os.environ.update(cluster_s3_env(hosts.Cluster.load(cluster)))
        overrides = [*overrides, *hosts_overrides(cluster)]
    cfg = load_config(config_path, overrides)
    run_dir = Path(cfg.train.run_dir)
    port = free_port()
    run_id = f"{cfg.run_id}-{port}"
    agents: dict[int, subprocess.Popen] = {}
    injector, lost, epoch = None, None, None
    if backend == "hosts":
        from megatrain.launch.host_faults import HostFaults

        injector = HostFaults(cfg.reliability.faults, hosts.Cluster.load(cluster), run_dir, host_role)
        lost = watch(cfg, hosts.Cluster.load(cluster), nodes, nproc_per_node) if watch else None
        epoch = _issue_epoch(cfg, nodes, nproc_per_node)
        agents = _start_in_hosts(cluster, str(Path(config_path).resolve()), nodes, nproc_per_node, run_id, overrides,
                                 {} if epoch is None else {EPOCH_ENV: str(epoch)})
    for position, node in enumerate(nodes if backend == "loopback" else []):
        staging = node_dir(nodes_dir, node) / "staging"
        node_overrides = [*overrides, f"checkpoint.staging_dir={staging}", "checkpoint.upload_mode=thread"]
        env = dict(os.environ, MEGATRAIN_NODE=str(node))
        agents[node] = subprocess.Popen(
            agent_command(config_path, len(nodes), nproc_per_node, port, run_id, position == 0, node_overrides),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        threading.Thread(target=_pump, args=(node, agents[node].stdout), daemon=True).start()
    evictions = [f for f in cfg.reliability.faults if f.kind == "evict_node" and f.node in agents]
    try:
        return _supervise(agents, evictions, run_dir, injector, lost, epoch)
    finally:
        verdict = getattr(lost, "verdict", None)
        # a lost host is out of reach: its agent is not signalled (the epoch fences its ranks instead);
        # a host evicted for a slow link is up and reachable: it is stopped like the others, so its ranks
        # hold nothing after the eviction and the host comes back empty for a later attempt or stage
        reachable = [proc for node, proc in agents.items()
                     if verdict is None or node != verdict["node"] or verdict.get("cause") == "slow_link"]
        for proc in reachable:
            _kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reachable:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(proc, signal.SIGKILL)
                proc.wait()


def _issue_epoch(cfg, nodes: list[int], nproc_per_node: int) -> int | None:
    """This attempt's fencing epoch from the cluster's Redis (None without one), kept in epochs.jsonl."""
    if not cfg.reliability.redis_url:
        return None
    path = Path(cfg.train.run_dir) / "epochs.jsonl"
    try:  # the newest epoch this run issued: the floor, should the store have restarted empty
        floor = max((json.loads(line)["epoch"] for line in path.read_text().splitlines() if line.strip()), default=0)
    except (OSError, ValueError, KeyError):
        floor = 0
    epoch, issued = issue_epoch(cfg.reliability.redis_url, cfg.run_id, floor=floor, nodes=nodes)
    row = {"epoch": epoch, "time": issued, "nodes": nodes, "world_size": len(nodes) * nproc_per_node}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")
    print(f"[launch_nodes] attempt on nodes {nodes}: epoch {epoch} (fences every earlier attempt)", flush=True)
    return epoch


def _timed(verdict: dict, injector, epoch: int | None, heartbeat_timeout_s: float | None) -> dict:
    """The verdict with when the fault was injected (its marker's time), when it was found, and the gap."""
    detected = time.time()
    fired = [f for f in (injector.fired if injector is not None else []) if f.get("node") == verdict["node"]]
    verdict = {**verdict, "epoch": epoch, "detected_at": detected, "heartbeat_timeout_s": heartbeat_timeout_s}
    if fired:
        verdict.update(fault=fired[-1]["kind"], fault_time=fired[-1]["time"],
                       detection_s=round(detected - fired[-1]["time"], 2))
    return verdict


def _supervise(agents: dict[int, subprocess.Popen], evictions: list, run_dir: Path, injector=None, lost=None,
               epoch: int | None = None) -> int:
    all_ended_at = None
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        if injector is not None:
            injector.poll(_last_step(run_dir))
        verdict = lost() if lost is not None else None
        if verdict is not None:
            verdict = _timed(verdict, injector, epoch, getattr(lost, "timeout_s", None))
            lost.verdict = verdict
            path = run_dir / "faults" / "host-lost.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(verdict))
            timing = (f" ({verdict['fault']} injected {verdict['detection_s']:.2f} s before)"
                      if "detection_s" in verdict else "")
            print(f"[launch_nodes] {verdict['message']}{timing}; stopping the other nodes", flush=True)
            return 1
        for fault in list(evictions):
            marker = evicted_marker(run_dir, fault.node)
            if fault.once and marker.exists():
                evictions.remove(fault)
            elif _last_step(run_dir) >= fault.step:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps({"node": fault.node, "step": fault.step, "time": time.time()}))
                print(f"[launch_nodes] injected fault evict_node: killing node {fault.node} at step "
                      f"{_last_step(run_dir)}", flush=True)
                _kill(agents[fault.node], signal.SIGKILL)
                evictions.remove(fault)
        ended = {node: proc.returncode for node, proc in agents.items() if proc.poll() is not None}
        failed = {node: code for node, code in ended.items() if code != 0}
        if failed and lost is not None:
            # an agent's end tells nothing of which host is lost: killed with its host, or its ranks failing
            # because a peer's host went ("connection closed by peer"); the heartbeats decide, a while
            all_ended_at = all_ended_at or time.monotonic()
            if time.monotonic() - all_ended_at < lost.patience_s:
                time.sleep(0.2)
                continue
        if failed:
            node, code = next(iter(failed.items()))
            print(f"[launch_nodes] node {node} lost (its agent exited with code {code}); stopping the other nodes",
                  flush=True)
            return code if code > 0 else 1
        if len(ended) == len(agents):
            return 0
        time.sleep(0.2)


def _kill(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatrain.launch.nodes", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes-dir", required=True, help="per-node directories (staging) go under it")
    parser.add_argument("--nodes", required=True, help="comma-separated node indices taking part, e.g. 0,1")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--backend", choices=BACKENDS, default="loopback",
                        help="loopback: agents on 127.0.0.1 here; hosts: each node inside its host of --cluster")
    parser.add_argument("--cluster", help="backend hosts: the cluster's name (megatrain cluster up)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.backend == "hosts" and not args.cluster:
        parser.error("--backend hosts needs --cluster NAME (megatrain cluster up --hosts N)")
    args.node_list = [int(n) for n in args.nodes.split(",") if n != ""]
    return args


def main(argv: list[str] | None = None, watch=None) -> int:
    args = parse_args(argv)
    nodes = args.node_list
    return run_nodes(args.config, nodes, args.nproc_per_node, args.nodes_dir, args.overrides, args.backend, args.cluster,
                     watch if args.backend == "hosts" else None)


if __name__ == "__main__":
    sys.exit(main())
