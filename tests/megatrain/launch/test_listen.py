"""Every store and socket a local job listens on binds loopback (issue 48), checked from /proc as an
operator's ``ss -ltnp`` would see it (tests/flows/listening_sockets.py)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))
from listening_sockets import ListeningSockets, listeners  # noqa: E402

from megatrain.launch.listen import bound_store_class, is_loopback, listening_socket, pin_to_loopback  # noqa: E402
from megatrain.launch.ranks import free_port, torchrun_command  # noqa: E402

WORKER = Path(__file__).with_name("listen_worker.py")


def test_a_store_this_process_hosts_listens_on_its_host_only():
    import torch.distributed as dist

    store = bound_store_class(dist.TCPStore)("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10),
                                             wait_for_workers=False)
    try:
        mine = [found for found in listeners(os.getpid()) if found.port == store.port]
        assert mine and all(found.address == "127.0.0.1" for found in mine), mine
        client = dist.TCPStore("127.0.0.1", store.port, 1, False, datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert store.get("key") == b"value"
    finally:
        del store


def test_an_address_of_another_machine_is_refused_by_name():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.77 .*not an address of this machine"):
        listening_socket("192.0.2.77")
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("192.0.2.77")


def test_gloo_and_nccl_are_pinned_to_loopback_unless_the_operator_chose():
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert pin_to_loopback(environ) == ["GLOO_SOCKET_IFNAME"]
    assert environ == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}


@pytest.mark.slow
def test_a_local_torchrun_job_listens_on_loopback_on_a_machine_whose_name_is_its_lan_address(tmp_path):
    """In namespaces of its own (network, mounts, host name), a machine called trainhost whose name
    resolves to its network address, 192.0.2.50, as a workstation's often does. torchrun's agent
    store (torch's binds every interface) and gloo's pairs (torch's follow the host name) must
    listen on 127.0.0.1 all the same."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n192.0.2.50 trainhost\n")
    command = torchrun_command("unused.yaml", 2)
    command = [*command[:command.index("-m", 3)], str(WORKER)]  # the launcher's torchrun, a small job
    setup = ("ip link set lo up && ip link add v0 type veth peer name v1 && ip addr add 192.0.2.50/24 dev v0 && "
             f"ip link set v0 up && ip link set v1 up && mount --bind {hosts} /etc/hosts && hostname trainhost && "
             "exec \"$@\"")
    with ListeningSockets(interval_s=0.1) as sampled:
        done = subprocess.run(["unshare", "--net", "--mount", "--uts", "sh", "-c", setup, "sh", *command],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not sampled.exposed(), sampled.exposed()
    agent = [found for found in sampled.seen if "torchrun" in found.command]  # the store, on 127.0.0.1
    ranks = [found for found in sampled.of(str(WORKER)) if "torchrun" not in found.command]
    assert agent and len({found.pid for found in ranks}) == 2, sorted(map(str, sampled.seen))
