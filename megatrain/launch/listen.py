"""Where this project's servers listen: on the one address they are reached at, never on every
interface.

torch's ``TCPStore`` binds its server to every interface (``*:<port>``) whatever host it is given,
and it has no authentication: on a shared machine, or a cluster network, anyone who reaches the
port can read and write the rendezvous. So every store this project hosts listens on a socket
bound here, handed to torch as ``master_listen_fd``:

- a rank that hosts the store (``parallel/init.py``: forked ranks, warm standby, one process)
  binds ``MASTER_ADDR``, the address its peers are given: 127.0.0.1 for every local launcher;
- torchrun's agents (``megatrain.launch.torchrun``, which local launches run in place of
  ``torch.distributed.run``) bind the rendezvous endpoint, and the node's own address for the
  workers' store (``--local-addr``);
- gloo's and NCCL's own sockets, where every rank is on this machine (``MASTER_ADDR`` is a
  loopback address), use the loopback interface (``pin_to_loopback``): left to themselves they
  listen on the address of the machine's name or its first network interface;
- the checkpoint keepers' peer port binds ``MEGATRAIN_KEEPER_HOST``, default 127.0.0.1
  (``checkpoint/keeper_peer.py``); Redis (``reliability/redis_server.py``), the temporary Prefect
  server and the Dask cluster bind 127.0.0.1 by their own options.

A cluster (``launcher: kubernetes``) hosts no TCP store at all: its ranks meet in the campaign's
Redis, which requires a password (``config/campaign.py`` sets ``parallel.init.store=redis`` and
``megatrain.launch.pod`` starts a pod's ranks without torchrun's agent store).

Engine code: imports neither torch nor prefect (the store class is passed in).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
IFF_LOOPBACK = 0x8  # a network interface's flag (/sys/class/net/<name>/flags)
# The communication libraries' own listening sockets: gloo's pairs and NCCL's bootstrap pick an
# interface by themselves (the host name's address; NCCL: the first that is not loopback).
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def listening_socket(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host``'s address (a name is resolved; IPv4 first) at ``port``
    (0: any free one). An address that is not this machine's is one clear OSError naming it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(exc.errno, f"cannot listen on {host} ({address[0]}): not an address of this machine; "
                                     "the store is hosted where MASTER_ADDR (the rendezvous endpoint) points") from None
        raise
    return sock


def bound_store_class(tcp_store: type) -> type:
    """``tcp_store`` (torch's ``TCPStore``) whose server, when this process hosts it, listens only
    on the host it is given, not on every interface. Same constructor as torch's."""

    class BoundTCPStore(tcp_store):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     *args: Any, **kwargs: Any) -> None:
            if is_master and kwargs.get("master_listen_fd") is None:
                sock = listening_socket(host_name, port)
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store's server owns the descriptor now
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "BoundTCPStore"
    return BoundTCPStore


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface ("lo" on Linux), None if not found."""
    for device in sorted(Path("/sys/class/net").glob("*")):
        try:
            if int((device / "flags").read_text(), 16) & IFF_LOOPBACK:
                return device.name
        except (OSError, ValueError):
            continue
    return None


def pin_to_loopback(environ: dict[str, str] | None = None) -> list[str]:
    """Make gloo and NCCL listen on the loopback interface, unless the variable is set already;
    for a job whose ranks are all on this machine. Returns the variables set."""
    environ = os.environ if environ is None else environ
    name = loopback_interface()
    if name is None:
        return []
    chosen = [variable for variable in SOCKET_IFNAME_VARIABLES if not environ.get(variable)]
    for variable in chosen:
        environ[variable] = name
    return chosen
