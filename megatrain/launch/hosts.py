"""A cluster on one machine: hosts as Linux namespaces on a bridge, brought up and always taken down.

    cluster = hosts.up(["node0", "node1", "redis"])   # root only; hosts.down(cluster.name) ends it
    subprocess.run(cluster.command("node0", ["hostname"]))

Each host is what a scheduler gives a pod: its own network namespace with one address on the
cluster's bridge (``eth0``, ``10.A.B.<i+1>/24``; the bridge itself is ``.254`` in the machine's own
namespace, where the control plane sits), its own hostname (UTS namespace), its own process ids
(PID namespace: another host's pids mean nothing here), and a private ``/dev/shm`` and ``/tmp``
(tmpfs in a mount namespace of its own; ``/etc/hosts`` names every host of the cluster). Everything
else of the machine's file system is shared, as a cluster's shared volume would be.

A host is held by its init, PID 1 of its namespace (``host_init.py``: mounts, hostname, reaps
orphans). A process is started inside a host with ``nsenter`` into the init's namespaces, as ``ip
netns exec`` or a container runtime does (``command``). SIGKILL of the init ends every process of the
host at once (the kernel kills a PID namespace with its PID 1), which is what ``kill_host`` and
``down`` do, after SIGKILLing every process that shares the host's network namespace anyway.

Ownership and clean-up: every namespace, link and bridge of a cluster is named by the cluster's
name, ``mtc<6 hex>`` (``PREFIX``), and its state file ``/run/megatrain/clusters/<name>.json`` names
the process that owns it (a test, a run; ``None`` for ``megatrain cluster up``). ``down(name)``
removes whatever carries the name, state file or not, so a run killed with SIGKILL leaves nothing
that the next ``down``, or ``sweep()`` (clusters whose owner is dead), cannot find.

Engine code: imports neither torch nor prefect. Needs root (``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN``);
without it ``available()`` says why, and the loopback launchers stay what runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFIX = "mtc"
STATE_DIR = Path("/run/megatrain/clusters")
NETNS_DIR = Path("/run/netns")
INIT_MODULE = Path(__file__).with_name("host_init.py")
START_S = 20.0  # a host's init mounts and names itself in milliseconds; a busy 2-core box is slow
_NAME = re.compile(rf"^{PREFIX}[0-9a-f]{{6}}$")


class HostsUnavailable(RuntimeError):
    """This machine cannot make hosts (not root, no ``ip``/``nsenter``/``unshare``)."""


@dataclass
class Host:
    role: str  # node0, redis, storage, head: the host's hostname in its UTS namespace too
    netns: str  # /run/netns/<netns>
    address: str  # eth0's IPv4 address on the cluster's bridge
    link: str  # the veth end on the bridge, in the machine's namespace: what a partition takes down
    init_pid: int = 0  # PID 1 of the host's PID namespace, as the machine's namespace numbers it


@dataclass
class Cluster:
    name: str
    subnet: str  # "10.A.B": hosts are .1 .. .n, the bridge .254
    bridge: str
    owner_pid: int | None
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.254"

    def host(self, role: str) -> Host:
        try:
            return self.hosts[role]
        except KeyError:
            raise KeyError(f"cluster {self.name} has no host {role!r} (its hosts: {', '.join(self.hosts)})") from None

    def command(self, role: str, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``argv`` run inside host ``role``: its network, hostname, mounts and process ids."""
        host = self.host(role)
        return ["nsenter", f"--target={host.init_pid}", "--net", "--uts", "--mount", "--pid",
                f"--wd={Path(cwd or os.getcwd()).resolve()}", "--", *argv]

    def env(self, role: str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a process started in ``role`` gets: its own /tmp, gloo and NCCL on eth0."""
        env = dict(os.environ if base is None else base)
        env.update(TMPDIR="/tmp", GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0",
                   MEGATRAIN_HOST=role, MEGATRAIN_HOST_ADDRESS=self.host(role).address)
        return env

    def pids(self, role: str) -> list[int]:
        """Every process of host ``role`` (all that share its network namespace), as this namespace numbers them."""
        return netns_pids(self.host(role).netns)

    def kill_host(self, role: str) -> list[int]:
        """The host dies: every process SIGKILLed, its link removed. Returns the pids killed."""
        host = self.host(role)
        _ip("link", "set", host.link, "down", check=False)  # first: a dead machine sends its peers no FIN
        killed = _kill_netns_processes(host.netns)
        _ip("link", "del", host.link, check=False)
        return killed

    def set_link(self, role: str, up: bool) -> None:
        """Take the host's link to the bridge down (a partition) or bring it up again."""
        _ip("link", "set", self.host(role).link, "up" if up else "down")

    def slow_link(self, role: str, rate: str = "1mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Rate-limit traffic towards the host (tbf on its bridge-side link; ``clear_link`` ends it)."""
        _run(["tc", "qdisc", "replace", "dev", self.host(role).link, "root", "tbf", "rate", rate,
              "burst", burst, "latency", latency])

    def clear_link(self, role: str) -> None:
        _run(["tc", "qdisc", "del", "dev", self.host(role).link, "root"], check=False)

    def save(self) -> Path:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        path = STATE_DIR / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, name: str) -> Cluster:
        path = STATE_DIR / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no cluster {name!r}: {path} does not exist (megatrain cluster list)") from None
        data["hosts"] = {role: Host(**host) for role, host in data["hosts"].items()}
        return cls(**data)


def available() -> str | None:
    """None when this machine can make hosts, else the reason it cannot."""
    if os.geteuid() != 0:
        return "hosts need root (network, mount, UTS and PID namespaces); the loopback launcher runs without"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "tc") if shutil.which(tool) is None]
    return f"hosts need {', '.join(missing)} on PATH" if missing else None


def up(roles: list[str], name: str | None = None, owner_pid: int | None = None) -> Cluster:
    """Bring up one host per role on a fresh bridge. On any failure what was made is taken down."""
    reason = available()
    if reason:
        raise HostsUnavailable(reason)
    if len(set(roles)) != len(roles) or not roles or len(roles) > 200:
        raise ValueError(f"host roles must be 1-200 distinct names, got {roles}")
    for role in roles:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,30}", role):
            raise ValueError(f"host role {role!r}: lowercase letters, digits and '-', starting with a letter")
    name = name or f"{PREFIX}{secrets.token_hex(3)}"
    if not _NAME.match(name):
        raise ValueError(f"cluster name {name!r} must be {PREFIX} and 6 hex digits (links are named after it)")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as lock:  # two clusters coming up at once never pick one subnet
        _lock(lock)
        cluster = Cluster(name, _free_subnet(), f"{name}br", owner_pid)
        cluster.save()  # before anything exists: a kill from here on leaves a state file that names it
    try:
        _ip("link", "add", cluster.bridge, "type", "bridge")
        _ip("addr", "add", f"{cluster.gateway}/24", "dev", cluster.bridge)
        _ip("link", "set", cluster.bridge, "up")
        for index, role in enumerate(roles):
            cluster.hosts[role] = Host(role, f"{name}-{role}", f"{cluster.subnet}.{index + 1}", f"{name}v{index}")
        hosts_file = _hosts_file(cluster)
        for host in cluster.hosts.values():
            _bring_up(cluster, host, hosts_file)
            cluster.save()
        return cluster
    except BaseException:
        down(name)
        raise


def down(name: str) -> dict[str, list]:
    """Remove everything named after cluster ``name``: processes, namespaces, links, its state file.
    Works without the state file (a run killed before it wrote one). Returns what it removed."""
    if not _NAME.match(name):
        raise ValueError(f"cluster name {name!r} must be {PREFIX} and 6 hex digits")
    removed: dict[str, list] = {"pids": [], "netns": [], "links": []}
    namespaces = [ns for ns in list_netns() if ns.startswith(f"{name}-")]
    for ns in namespaces:
        removed["pids"] += _kill_netns_processes(ns)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
        removed["netns"].append(ns)
    for link in list_links():
        if link.startswith(name):
            _ip("link", "del", link, check=False)
            removed["links"].append(link)
    for path in STATE_DIR.glob(f"{name}.*") if STATE_DIR.exists() else []:  # state, hosts file, secrets
        path.unlink(missing_ok=True)
    return removed


def clusters() -> list[str]:
    """Every cluster this machine holds anything of: state files, namespaces and links by prefix."""
    names = {p.stem for p in STATE_DIR.glob(f"{PREFIX}*.json")} if STATE_DIR.exists() else set()
    names |= {ns.split("-", 1)[0] for ns in list_netns()}
    names |= {link[: len(PREFIX) + 6] for link in list_links()}
    return sorted(n for n in names if _NAME.match(n))


def sweep() -> list[str]:
    """Take down the clusters whose owner process is gone (a test run or campaign killed with
    SIGKILL) and those with no state file left; those of ``megatrain cluster up`` (no owner) stay."""
    swept = []
    for name in clusters():
        try:
            owner = Cluster.load(name).owner_pid
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            owner = -1
        if owner is not None and (owner == -1 or not alive(owner)):
            down(name)
            swept.append(name)
    return swept


def list_netns() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}*")) if NETNS_DIR.exists() else []


def list_links() -> list[str]:
    return sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(PREFIX))


def netns_pids(netns: str) -> list[int]:
    """Processes whose network namespace is ``/run/netns/<netns>`` (compared by inode, as ``ip netns pids``)."""
    try:
        target = os.stat(NETNS_DIR / netns)
    except FileNotFoundError:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                st = os.stat(entry / "ns" / "net")
            except OSError:
                continue
            if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
                found.append(int(entry.name))
    return found


def _kill_netns_processes(netns: str, wait_s: float = 10.0) -> list[int]:
    pids = netns_pids(netns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s  # dead once a zombie (its reaping is its parent's, not ours)
    while (netns_pids(netns) or any(alive(pid) for pid in pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


def _bring_up(cluster: Cluster, host: Host, hosts_file: Path) -> None:
    _ip("netns", "add", host.netns)
    _ip("link", "add", host.link, "type", "veth", "peer", "name", f"{host.link}p")
    _ip("link", "set", f"{host.link}p", "netns", host.netns)
    _ip("link", "set", host.link, "master", cluster.bridge, "up")
    inside = ["nsenter", f"--net={NETNS_DIR / host.netns}"]
    for argv in (["link", "set", f"{host.link}p", "name", "eth0"], ["addr", "add", f"{host.address}/24", "dev", "eth0"],
                 ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
        _run([*inside, "ip", *argv])
    # unshare --fork: its child is PID 1 of the new PID namespace, with /proc mounted for that namespace;
    # setsid --fork: the host belongs to no process of ours (its end is down's SIGKILL, never our exit)
    init = subprocess.Popen(
        [*inside, "setsid", "--fork", "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
         sys.executable, "-S", str(INIT_MODULE), host.role, str(hosts_file)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    # the init prints "ready" once mounted and named; a line comes within START_S or the host failed
    ready = init.stdout.readline().decode().strip() if select.select([init.stdout], [], [], START_S)[0] else ""
    if ready != "ready":
        init.kill()
        raise RuntimeError(f"host {host.role} of {cluster.name}: its init did not start in {START_S:.0f} s: "
                           f"{ready or 'no output'} (exit {init.wait(timeout=5)})")
    init.stdout.close()
    init.wait(timeout=START_S)  # setsid's parent: it exits as soon as it has forked
    host.init_pid = _namespace_init(host.netns)


def _namespace_init(netns: str) -> int:
    """The pid (in this namespace) of the process that is PID 1 of the host's PID namespace."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        for pid in netns_pids(netns):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if len(nspid) > 1 and nspid[-1] == "1":
                return pid
        time.sleep(0.02)
    raise RuntimeError(f"host namespace {netns}: no PID 1 found in {START_S:.0f} s")


def _hosts_file(cluster: Cluster) -> Path:
    """The /etc/hosts every host of the cluster sees: localhost and each host by its role."""
    path = STATE_DIR / f"{cluster.name}.hosts"
    lines = ["127.0.0.1 localhost", *(f"{h.address} {h.role}" for h in cluster.hosts.values())]
    path.write_text("\n".join(lines) + "\n")
    return path


def _lock(handle, timeout_s: float = START_S) -> None:
    """The machine's cluster lock, held for milliseconds by whoever picks a subnet; bounded anyway."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{STATE_DIR / '.lock'}: held by another process for {timeout_s:.0f} s") from None
            time.sleep(0.02)


def _free_subnet() -> str:
    """A 10.A.B.0/24 that no address of this machine and no other cluster's state file uses."""
    taken = set(re.findall(r"inet (10\.\d+\.\d+)\.\d+", _run(["ip", "-4", "-o", "addr"]).stdout))
    for path in STATE_DIR.glob(f"{PREFIX}*.json"):
        try:
            taken.add(json.loads(path.read_text())["subnet"])
        except (OSError, ValueError, KeyError):
            continue
    for _ in range(1000):
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if subnet not in taken:
            return subnet
    raise RuntimeError("no free 10.200-250.x.0/24 subnet for a cluster")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead to its cluster
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *argv], check=check)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
    return result
