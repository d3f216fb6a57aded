"""Start torch.distributed for this process: connect a rendezvous store, pass the join barrier,
create the world communicator. Gloo on CPU, NCCL on GPU, timeouts and choices from the config.

The fast path (MegaScale §3.5), each choice in ``parallel.init`` (``InitConfig``):

- the store: torch's libuv ``TCPStore`` (default; torchrun's agent store under torchrun; the
  server rank 0 hosts listens on ``MASTER_ADDR`` only, ``launch/listen.py``) or a ``RedisStore``
  (any rank can reach it, nothing waits for rank 0 to come up). Its keys are
  namespaced per launch and restart (``MASTER_ADDR:MASTER_PORT``, torchrun's restart count), so a
  relaunch never reads an earlier rendezvous;
- the join barrier (``rendezvous.join``): O(1) store operations per rank, a clear error naming the
  ranks that never joined, and one naming a rank that joined twice;
- no global store barrier after ``init_process_group`` (torch's default since 2.1, which we rely
  on: ``TORCH_DIST_INIT_BARRIER`` stays unset) and groups created in one ordered pass
  (``dims.build_process_groups``);
- on NCCL, ``device_id`` binds the device at init: the world communicator is created eagerly and
  ``new_group`` splits it (``ncclCommSplit``) without any store traffic.

A Redis restart during start-up (``StoreLost``) makes every rank start the rendezvous over in the
new server's namespace (the server's run id is part of it), so ranks that arrive late and ranks
that had already joined meet again. Each phase is timed by the ``StartupTimer`` passed in.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from megatrain.config import InitConfig
from megatrain.launch.listen import bound_store_class, is_loopback, pin_to_loopback
from megatrain.parallel.rendezvous import CountingStore, join
from megatrain.observe.startup import StartupTimer
from megatrain.waits import bounded, waiting

log = logging.getLogger("megatrain")

STORE_LOST_RETRIES = 3  # rendezvous restarts after a Redis restart before giving up


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    store: dist.Store | None = None  # the rendezvous store (counts its operations: ``store.ops``)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_namespace(run_id: str) -> str:
    """Keys of one launch attempt: the run, the launch's master endpoint, torchrun's restart count."""
    return (f"{run_id}:{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '0')}"
            f":attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def connect_store(init: InitConfig, rank: int, world: int, run_id: str, redis_url: str | None,
                  timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store ``init`` selects, wrapped in a ``CountingStore``."""
    url = init.redis_url or redis_url
    kind = ("redis" if url else "tcp") if init.store == "auto" else init.store
    namespace = launch_namespace(run_id)
    if kind == "redis":
        if not url:
            raise ValueError("parallel.init.store=redis needs parallel.init.redis_url or reliability.redis_url")
        from megatrain.parallel.redis_store import RedisStore

        probe = RedisStore(url, namespace, timeout=timeout)
        # the server's identity is part of the namespace: after a restart everyone meets afresh
        probe.prefix = f"megatrain:{namespace}:{probe.server_id[:12]}:{probe.scope}store:"  # scope: the run's token
        return CountingStore(probe, where=_redacted(url), deadline_s=timeout.total_seconds())
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    # rank 0's server listens on MASTER_ADDR only (torch's own binds every interface, unauthenticated)
    master = rank == 0 and not agent_store
    # a client's handshake with a server that accepted and never answers blocks past c10d's timeout
    with waiting("rendezvous store: connect", f"{host}:{port}", timeout.total_seconds() + CountingStore.GRACE_S) as wait:
        tcp = bounded(lambda: bound_store_class(dist.TCPStore)(host, port, world, is_master=master, timeout=timeout,
                                                               wait_for_workers=False, use_libuv=True),
                      wait, "the server accepted the connection and did not answer")
    return CountingStore(dist.PrefixStore(f"megatrain/{namespace}/", tcp), where=f"{host}:{port}",
                         deadline_s=timeout.total_seconds())


def _redacted(url: str) -> str:
    """A store URL for a message: without a password."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl()


def _is_store_lost(exc: BaseException) -> bool:
    """A ``StoreLost`` raised inside c10d's C++ comes back as a plain error with its message."""
    return type(exc).__name__ == "StoreLost" or "the rendezvous keys of" in str(exc)


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: float = 600.0, *, init: InitConfig | None = None,
    run_id: str = "megatrain", redis_url: str | None = None, timer: StartupTimer | None = None,
) -> DistEnv:
    """Join the process group torchrun describes in the environment, or make a world of one.

    A single process (``megatrain train``) still gets a real process group so every code path
    (DeepSpeed, collectives, checkpoint broadcast) is the same as under torchrun.
    """
    if "RANK" not in os.environ:  # a plain single process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    init = init or InitConfig()
    timer = timer or StartupTimer(rank)

    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    device_obj = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if not use_cuda:
        # Subnormal floats are ~10x slower on x86 CPUs, and a model that fits its data well makes
        # them: a confident softmax's backward is full of them (the chaos ETTR run's tiny model at
        # loss 0.015: backward 288 ms per step with them, 24 ms flushed to zero). GPUs flush anyway.
        torch.set_flush_denormal(True)

    # DeepSpeed JIT-compiles a shared-memory comm op on CPU at init (~20 s); gloo needs none.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    store = None
    if is_loopback(os.environ["MASTER_ADDR"]):  # every rank on this machine: gloo/NCCL listen on loopback too
        pin_to_loopback()
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        device_id = device_obj if backend == "nccl" and init.eager_nccl else None
        for attempt in range(STORE_LOST_RETRIES + 1):
            try:
                with timer.phase("store_connect"):
                    store = connect_store(init, rank, world, run_id, redis_url, timeout)
                with timer.phase("rendezvous"):
                    join(store, rank, world, init.join_timeout_s)
                with timer.phase("world_group"):
                    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                            device_id=device_id)
                break
            except Exception as exc:
                if not _is_store_lost(exc) or attempt == STORE_LOST_RETRIES:
                    raise
                log.warning("rank %d: the rendezvous store restarted during start-up; joining again (%s)", rank, exc)
                if dist.is_initialized():
                    dist.destroy_process_group()
        timer.watch_store(store)
    # DeepSpeed adopts the group that now exists (it initialises nothing when one does).
    deepspeed.init_distributed(dist_backend=backend, dist_init_required=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   device=device_obj, backend=backend, store=store)


def shutdown_distributed() -> None:
    """Always destroy the group at exit, or rank 0 aborts and torchrun reports a failure."""
    if dist.is_initialized():
        dist.destroy_process_group()
