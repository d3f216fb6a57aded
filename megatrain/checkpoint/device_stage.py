"""Host memory and the GPU for the keeper's copies: page-locking a slot's mapping, and a restore's
host bytes onto the GPU at DMA speed while the CPU checks them.

``pin``: a keeper slot is the keeper's shared memory mapped into the rank (memory.py), pageable, so
a save's device-to-host copies ran at the driver's staging speed (0.5 s per 1.7 GB snapshot of
gpt-125m on an H200, every ``memory_interval`` steps). Registered with CUDA once, when the slot
is first mapped (the mapping is reused while the keeper keeps the slot), the copies are DMA.

A keeper copy (memory.py) is one shared-memory buffer on the host: 18.4 GB for the 1.3B recipe's
state. Copying it tensor by tensor from that pageable memory runs at the driver's staging speed
and leaves the CPU's cores idle, and the checksums then run after it, not beside it. Here the
buffer goes to one device buffer in 64 MiB chunks instead: a few threads each copy their chunks
into two pinned bounce buffers of their own and queue the DMA on their own stream, so host
copies, DMA and (in the caller's threads) the sha256 of every chunk all run at once. The tensors
are then views into the device buffer, and restore's copies into the model and optimizer are
device-to-device.

The device buffer is a second copy of the state on the GPU for as long as the restore runs, so it
is used only when the GPU has that much free memory with room to spare; otherwise the caller
keeps the host views (the plain path).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 64 << 20
COPY_THREADS = 8
HEADROOM = 2 << 30  # left free on the GPU beside the staged copy (allocator slack, the first step's workspace)


def pin(host: torch.Tensor) -> bool:
    """Page-lock ``host``'s memory in place (cudaHostRegister); False where there is no CUDA or
    the driver refuses (the copies still work, pageable). ``unpin`` before the memory is unmapped."""
    if not torch.cuda.is_available() or host.numel() == 0:
        return False
    return int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)) == 0


def unpin(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes + HEADROOM <= free


def stage_on_device(host: torch.Tensor, nbytes: int, device: torch.device,
                    threads: int = COPY_THREADS) -> torch.Tensor:
    """The first ``nbytes`` of the uint8 host tensor ``host`` as a uint8 tensor on ``device``."""
    staged = torch.empty(nbytes, dtype=torch.uint8, device=device)
    spans = [(start, min(start + CHUNK, nbytes)) for start in range(0, nbytes, CHUNK)]
    workers = max(1, min(threads, len(spans)))

    def copy_every(worker: int) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        bounce = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done: list[torch.cuda.Event | None] = [None, None]
        for i, (start, end) in enumerate(spans[worker::workers]):
            slot = i % 2
            if done[slot] is not None:
                done[slot].synchronize()  # its last DMA has read the bounce buffer
            bounce[slot][:end - start].copy_(host[start:end])
            with torch.cuda.stream(stream):
                staged[start:end].copy_(bounce[slot][:end - start], non_blocking=True)
                done[slot] = stream.record_event()
        stream.synchronize()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage") as pool:
        list(pool.map(copy_every, range(workers)))
    return staged
