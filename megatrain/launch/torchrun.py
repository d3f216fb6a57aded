"""torchrun, with every store its agent hosts listening on one address instead of every interface.

    python -m megatrain.launch.torchrun [torchrun's arguments]

is ``python -m torch.distributed.run`` as it is (same arguments, output, exit codes), except that
the ``TCPStore`` servers its agent starts (the static rendezvous's store at ``--master-addr``, the
c10d rendezvous's at ``--rdzv-endpoint``, the workers' shared store at ``--local-addr``) bind that
address only (``megatrain/launch/listen.py`` says why). The local launchers run their torchrun
agents through it (``ranks.torchrun_command``, ``nodes.agent_command``), all on 127.0.0.1.

Imports torch only when run.
"""

from __future__ import annotations

import sys


def bind_agent_stores() -> None:
    """Make the stores torchrun's rendezvous code creates in this process listen where they are reached."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    from megatrain.launch.listen import bound_store_class

    bound = bound_store_class(dist.TCPStore)
    dist.TCPStore = bound  # dynamic_rendezvous's workers' store: looked up as dist.TCPStore when made
    static_tcp_rendezvous.TCPStore = bound  # imported by name when torch loaded these modules
    c10d_rendezvous_backend.TCPStore = bound


def main(argv: list[str] | None = None) -> None:
    bind_agent_stores()
    from torch.distributed import run

    sys.argv = ["torchrun", *(sys.argv[1:] if argv is None else argv)]
    run.main()


if __name__ == "__main__":
    main()
