"""Start torch.distributed for this process: gloo on CPU, NCCL on GPU, timeouts from the config."""

from __future__ import annotations

import datetime
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
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

    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"

    # DeepSpeed JIT-compiles a shared-memory comm op on CPU at init (~20 s); gloo needs none.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s), rank=rank, world_size=world,
            dist_init_required=True,
        )
    return DistEnv(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"), backend=backend,
    )


def shutdown_distributed() -> None:
    """Always destroy the group at exit, or rank 0 aborts and torchrun reports a failure."""
    if dist.is_initialized():
        dist.destroy_process_group()
