"""The services of a one-machine cluster, each on a host of its own, and ``megatrain cluster``.

    megatrain cluster up --hosts 4        # node0..node3, head, redis (Redis), storage (S3: moto)
    megatrain cluster list                # clusters on this machine, their hosts and addresses
    megatrain cluster exec NAME HOST -- CMD...
    megatrain cluster down NAME | --all | --swept

``up`` prints the cluster's name, its hosts and the endpoints (``redis://<redis host>:6379``, its
password in ``/run/megatrain/clusters/<name>.redis``, mode 0600; ``http://<storage host>:5000`` as
the S3 endpoint with moto's test credentials, and the bucket ``s3://megatrain``). Redis listens on the
redis host's address, moto on the storage host's: each is reached over the bridge, as a cluster's
services are, and dies with its host (``hosts.Cluster.kill_host``). The fault ``redis_host_down``
(``launch/host_faults.py``) kills the redis host's processes and cuts its link for a while, then
``restart`` brings Redis back on the same address with the same password and, as configured here, no
persistence (``save ""``, no AOF: it comes back empty, and what uses it writes again: heartbeats
every interval, a missing fencing epoch reads as 0).

The storage host is the cluster's durable checkpoint store: ``up`` creates the bucket ``s3://megatrain``
(``BUCKET``) and the hosts launcher hands every rank the endpoint and moto's test credentials
(``s3_env``), so with ``checkpoint.durable_url=s3://megatrain/<run>`` the ranks upload and commit over
the bridge and restores read from there, no checkpoint folder shared between hosts. moto keeps its
objects in memory, where a real object store keeps them on disks that outlive an outage. A restarted
moto would come back empty, which would be a lost store, not an outage; so ``storage_host_down`` does
not kill it: ``freeze`` SIGSTOPs the host's processes (its memory kept, as the disks are) while the link
is down, and ``thaw`` SIGCONTs them once it is up. From outside that is a dead machine (no answer, no
FIN, no RST: its peers' packets are dropped at the bridge) that comes back with its data. A request in
flight waits, as against a real S3 outage: for a few seconds' outage TCP resends it once the link is up
(botocore's timeouts are 60 s), a longer one reaches botocore's, s3fs's and the checkpoint uploader's
retries.

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatrain.launch import hosts

REDIS_PORT = 6379
S3_PORT = 5000
BUCKET = "megatrain"  # the durable checkpoint store's bucket, created by ``up``
# moto accepts any credentials; botocore refuses to sign a request without some
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
SERVICE_ROLES = ("head", "redis", "storage")


def node_roles(n: int) -> list[str]:
    return [f"node{i}" for i in range(n)]


def start_redis(cluster: hosts.Cluster, role: str = "redis", password: str | None = None, detach: bool = False) -> str:
    """redis-server on ``role``'s address with a fresh password (kept 0600 beside the state file),
    or with ``password``, the one its clients already hold (a restart). ``detach``: the server is the
    host init's child, not ours (a restart by a launcher that ends before the cluster does)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not installed (make services)")
    secret = hosts.STATE_DIR / f"{cluster.name}.redis"
    if password is None:
        password = secrets.token_urlsafe(24)
        secret.touch(mode=0o600)
        secret.write_text(password)
    address = cluster.host(role).address
    conf = (f"port {REDIS_PORT}\nbind {address}\nprotected-mode yes\nsave \"\"\nappendonly no\n"
            f"requirepass {password}\n")  # on stdin: no password in the host's process list
    proc = subprocess.Popen(cluster.command(role, [*_detached(detach), binary, "-"]), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    proc.stdin.write(conf)
    proc.stdin.close()
    _wait_port(cluster, address, REDIS_PORT, proc, "redis-server")
    if detach:
        proc.wait(timeout=30)  # nsenter ends once setsid has forked
    return f"redis://{address}:{REDIS_PORT}"


def _detached(detach: bool) -> list[str]:
    # setsid --fork inside the host: the server's parent exits at once, so the host's init adopts it
    return ["setsid", "--fork"] if detach else []


def start_s3(cluster: hosts.Cluster, role: str = "storage", detach: bool = False) -> str:
    """moto's S3 server on ``role``'s address: the durable store every host reaches over the bridge."""
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if binary is None:
        raise FileNotFoundError("moto_server not installed (moto[server] is a dependency of megatrain)")
    address = cluster.host(role).address
    proc = subprocess.Popen(cluster.command(role, [*_detached(detach), binary, "-H", address, "-p", str(S3_PORT)]),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_port(cluster, address, S3_PORT, proc, "moto_server")
    if detach:
        proc.wait(timeout=30)
    return f"http://{address}:{S3_PORT}"


def create_bucket(endpoint: str, bucket: str = BUCKET) -> str:
    """``bucket`` on the S3 server at ``endpoint`` (an existing one is kept); returns ``s3://bucket``."""
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    try:  # moto checks no signature: a plain PUT is CreateBucket
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409: BucketAlreadyOwnedByYou
            raise RuntimeError(f"S3 at {endpoint}: bucket {bucket} not created: HTTP {exc.code}") from exc
    return f"s3://{bucket}"


def s3_env(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the cluster's S3 (megatrain/storage/urls.py reads the endpoint)."""
    return {"MEGATRAIN_S3_ENDPOINT": endpoint, **S3_CREDENTIALS}


def freeze(cluster: hosts.Cluster, role: str) -> list[int]:
    """SIGSTOP every process of host ``role`` but its init (their memory kept); returns their pids."""
    return _signal_host(cluster, role, signal.SIGSTOP)


def thaw(cluster: hosts.Cluster, role: str, pids: list[int]) -> None:
    """SIGCONT ``pids`` (``freeze``'s), then wait until the host's service answers again."""
    deadline = time.monotonic() + 5
    while True:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        # nsenter (what started the service in the host) stops itself when it sees its child stop, and
        # that notice may come after our SIGCONT: continue whatever is still stopped, until none is
        time.sleep(0.05)
        if not any(_stopped(pid) for pid in pids) or time.monotonic() > deadline:
            break
    if role == "storage":
        _wait_port(cluster, cluster.host(role).address, S3_PORT, None, "moto_server (thawed)")


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:  # gone
        return False


def _signal_host(cluster: hosts.Cluster, role: str, sig: int) -> list[int]:
    init = cluster.host(role).init_pid
    pids = [pid for pid in cluster.pids(role) if pid != init]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def restart(cluster: hosts.Cluster, role: str) -> str:
    """The service of host ``role`` started again on the same address (after ``redis_host_down``):
    Redis with the password its clients hold; moto as it started, with an empty bucket (a store whose
    disks were lost: ``storage_host_down`` freezes moto instead, see the module's docstring)."""
    if role == "redis":
        return start_redis(cluster, role, password=(hosts.STATE_DIR / f"{cluster.name}.redis").read_text(),
                           detach=True)
    if role == "storage":
        endpoint = start_s3(cluster, role, detach=True)
        create_bucket(endpoint)
        return endpoint
    raise ValueError(f"host {role!r} runs no service of a cluster (redis, storage)")


def _wait_port(cluster: hosts.Cluster, address: str, port: int, proc: subprocess.Popen | None, what: str,
               timeout_s: float = 30.0) -> None:
    """Until ``address:port`` accepts, from this machine's namespace over the bridge (``proc``: the
    server just started, whose early exit ends the wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError:
            if (proc is not None and proc.poll() not in (None, 0)) or time.monotonic() > deadline:
                raise RuntimeError(f"{what} of cluster {cluster.name} did not answer on {address}:{port}") from None
            time.sleep(0.05)


def up(n_nodes: int, services: bool = True, owner_pid: int | None = None) -> tuple[hosts.Cluster, dict[str, str]]:
    """``n_nodes`` node hosts, and with ``services`` a head, a Redis and a storage host running theirs."""
    roles = node_roles(n_nodes) + (list(SERVICE_ROLES) if services else [])
    cluster = hosts.up(roles, owner_pid=owner_pid)
    endpoints: dict[str, str] = {}
    try:
        if services:
            endpoints = {"redis": start_redis(cluster), "s3": start_s3(cluster)}
            endpoints["bucket"] = create_bucket(endpoints["s3"])
            (hosts.STATE_DIR / f"{cluster.name}.endpoints.json").write_text(json.dumps(endpoints))
    except BaseException:
        hosts.down(cluster.name)
        raise
    return cluster, endpoints


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p_up = sub.add_parser("up", help="bring up node hosts (and head, redis, storage hosts)")
    p_up.add_argument("--hosts", type=int, required=True, help="how many node hosts (node0..)")
    p_up.add_argument("--no-services", action="store_true", help="node hosts only: no head, Redis or S3 host")
    p_down = sub.add_parser("down", help="remove a cluster: processes, namespaces, links, state")
    p_down.add_argument("name", nargs="?")
    p_down.add_argument("--all", action="store_true", help="every cluster of this machine (prefix mtc)")
    sub.add_parser("sweep", help="remove clusters whose owning run is gone")
    sub.add_parser("list", help="clusters of this machine and their hosts")
    p_exec = sub.add_parser("exec", help="run a command inside one host")
    p_exec.add_argument("name")
    p_exec.add_argument("host")
    p_exec.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    reason = hosts.available()
    if reason:
        print(f"megatrain cluster: {reason}", file=sys.stderr)
        return 2
    if args.action == "up":
        if args.hosts < 1:
            parser.error("--hosts must be at least 1")
        cluster, endpoints = up(args.hosts, services=not args.no_services)
        print(f"cluster {cluster.name} on {cluster.subnet}.0/24 (bridge {cluster.bridge}, {cluster.gateway})")
        for host in cluster.hosts.values():
            print(f"  {host.role:<8} {host.address:<15} netns {host.netns}")
        for what, url in endpoints.items():
            print(f"  {what:<8} {url}")
        print(f"take it down with: megatrain cluster down {cluster.name}")
        return 0
    if args.action == "down":
        names = hosts.clusters() if args.all else [args.name] if args.name else []
        if not names and not args.all:
            parser.error("down needs a cluster name or --all")
        for name in names:
            removed = hosts.down(name)
            print(f"cluster {name} down: {len(removed['pids'])} processes, {len(removed['netns'])} namespaces, "
                  f"{len(removed['links'])} links removed")
        return 0
    if args.action == "sweep":
        for name in hosts.sweep():
            print(f"cluster {name} swept (its owner is gone)")
        return 0
    if args.action == "list":
        for name in hosts.clusters():
            try:
                cluster = hosts.Cluster.load(name)
                print(f"{name} {cluster.subnet}.0/24 owner {cluster.owner_pid or 'megatrain cluster up'}: "
                      + ", ".join(f"{h.role} {h.address}" for h in cluster.hosts.values()))
            except FileNotFoundError:
                print(f"{name}: leftovers without a state file (megatrain cluster down {name})")
        return 0
    cluster = hosts.Cluster.load(args.name)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return subprocess.run(cluster.command(args.host, argv), env=cluster.env(args.host)).returncode


def main() -> None:
    sys.exit(cli())


if __name__ == "__main__":
    main()
