"""Stage 1: device -> reused host buffers (the only part the training loop waits for) -> local disk.

``Snapshotter.snapshot`` does, on the training thread:

1. wait until the previous snapshot's staging write has finished (its buffers are about to be
   reused; the *upload* of that snapshot is not waited for);
2. copy every tensor into host buffers allocated once, at the first save, and reused after:
   allocating and pinning 16 GB takes 5-7 s on an H200 host, copying into ready pinned memory
   0.3 s. The buffers are views into one slab, pinned (only when CUDA exists) with a single
   cudaHostRegister: torch's pinned allocator rounds every block up to a power of two, which
   would cost up to twice the host memory for a 20 GB state;
3. on a GPU, issue the copies on a side CUDA stream that first waits for the compute stream (so it
   sees the finished optimizer step), and synchronise only that stream before returning.

Then a background thread writes the buffers to ``<staging_dir>/step-XXXXXXXX/`` (safetensors +
JSON, hashed while written) and writes this rank's ``rank-XXXXX.done.json`` marker last. Training
resumes as soon as step 3 returns; the next optimizer step may overwrite the device tensors because
the host copy is already complete.

The write first checks the staging disk's free space against the bytes it needs, and a write that
fails anyway (the disk filled meanwhile, an I/O error) removes what it wrote. Either way the error
is kept in the step's future and raised in the training loop (``raise_if_failed``, the next
``snapshot``, ``close``): a checkpoint that was not staged must fail the rank, not vanish.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatrain import storage
from megatrain.checkpoint.files import FileRecord, rank_marker, step_dir_name, write_json, write_safetensors

log = logging.getLogger("megatrain.checkpoint")


@dataclass
class RankSnapshot:
    """What one rank stages for one step."""

    step: int
    rank: int
    tensor_files: dict[str, dict[str, torch.Tensor]]  # file name -> tensor name -> live tensor (any device)
    json_files: dict[str, Any]  # file name -> JSON-able value
    marker: dict[str, Any] = field(default_factory=dict)  # extra fields of the rank's done marker


@dataclass
class StagedStep:
    """A rank's files of one step, complete on the local staging disk."""

    step: int
    path: Path
    files: dict[str, FileRecord]
    bytes: int
    write_s: float


@dataclass
class SnapshotTiming:
    wait_s: float  # waiting for the previous staging write
    copy_s: float  # device -> host copy: the training loop's real stall
    allocated: bool  # whether host buffers had to be (re)allocated this time

    @property
    def blocked_s(self) -> float:
        return self.wait_s + self.copy_s


class HostSlab:
    """One host allocation holding a view per tensor, reused while the tensor layout stays the same."""

    ALIGN = 64  # every view starts aligned for any dtype (and for fast copies)

    def __init__(self, layout: list[tuple[str, str, torch.Size, torch.dtype]], pin: bool):
        offsets, total = [], 0
        for _, _, shape, dtype in layout:
            offsets.append(total)
            nbytes = shape.numel() * dtype.itemsize
            total += nbytes + (-nbytes % self.ALIGN)
        self.layout, self.nbytes, self.pinned_by = layout, total, "none"
        self._storage = torch.empty(max(total, 1), dtype=torch.uint8)
        if pin:
            self._pin()
        self.views: dict[tuple[str, str], torch.Tensor] = {}
        for (file, name, shape, dtype), offset in zip(layout, offsets):
            raw = self._storage[offset:offset + shape.numel() * dtype.itemsize]
            self.views[(file, name)] = raw.view(dtype).view(shape)

    def _pin(self) -> None:
        result = int(torch.cuda.cudart().cudaHostRegister(self._storage.data_ptr(), self._storage.numel(), 0))
        if result == 0:
            self.pinned_by = "cudaHostRegister"
            return
        log.warning("cudaHostRegister failed (cudaError %d); using torch's pinned allocator", result)
        self._storage = torch.empty(self._storage.numel(), dtype=torch.uint8, pin_memory=True)
        self.pinned_by = "pin_memory"

    def release(self) -> None:
        if self.pinned_by == "cudaHostRegister":
            torch.cuda.cudart().cudaHostUnregister(self._storage.data_ptr())
            self.pinned_by = "none"
        self.views.clear()


class Snapshotter:
    """Owns the reusable host buffers and the staging thread of one rank."""

    def __init__(self, staging_dir: str | Path, device: torch.device):
        self.staging_dir = Path(staging_dir)
        self.device = device
        self._pin = torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slab: HostSlab | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
        self._pending: Future | None = None
        self.last_timing: SnapshotTiming | None = None

    @property
    def host_bytes(self) -> int:
        return self._slab.nbytes if self._slab else 0

    @property
    def pinned_by(self) -> str:
        return self._slab.pinned_by if self._slab else "none"

    def step_dir(self, step: int) -> Path:
        return self.staging_dir / step_dir_name(step)

    def snapshot(self, snap: RankSnapshot) -> Future:
        """Copy ``snap`` to host memory (blocking) and stage it to disk (in the background).
        Returns a future of the ``StagedStep``; it raises if writing failed."""
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter()
        json_files = json.loads(json.dumps(snap.json_files))  # a private copy: the trainer moves on
        marker = json.loads(json.dumps(snap.marker))
        host, allocated = self._copy_to_host(snap.tensor_files)
        self.last_timing = SnapshotTiming(wait_s=waited - start, copy_s=time.perf_counter() - waited, allocated=allocated)
        self._pending = self._writer.submit(self._write, snap.step, snap.rank, host, json_files, marker)
        return self._pending

    def wait(self) -> None:
        """Block until the last staging write is done; raise its error, if any. A checkpoint that
        could not be staged is lost: the rank must fail loudly, never train on as if it were safe."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def raise_if_failed(self) -> None:
        """Raise the error of a staging write that has already failed (never blocks)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._slab is not None:
                self._slab.release()
                self._slab = None

    def _buffers(self, tensor_files: dict[str, dict[str, torch.Tensor]]) -> bool:
        """Make sure the slab fits this layout; returns whether it had to be (re)allocated."""
        layout = [(file, name, t.shape, t.dtype) for file, tensors in tensor_files.items() for name, t in tensors.items()]
        if self._slab is not None and self._slab.layout == layout:
            return False
        if self._slab is not None:
            log.warning("checkpoint tensors changed shape or set; reallocating host buffers")
            self._slab.release()
        self._slab = HostSlab(layout, self._pin)
        log.info("checkpoint host buffers: %.2f GB (%s)", self._slab.nbytes / 1e9,
                 f"pinned by {self._slab.pinned_by}" if self._pin else "pageable: no CUDA")
        return True

    def _copy_to_host(self, tensor_files: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, dict[str, torch.Tensor]], bool]:
        allocated = self._buffers(tensor_files)
        views = self._slab.views
        host: dict[str, dict[str, torch.Tensor]] = {}
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for file, tensors in tensor_files.items():
                host[file] = {}
                for name, tensor in tensors.items():
                    buf = views[(file, name)]
                    buf.copy_(tensor, non_blocking=tensor.is_cuda)
                    host[file][name] = buf
        if self._stream is not None:
            self._stream.synchronize()  # only the copy stream: compute keeps running
        return host, allocated

    def _write(self, step: int, rank: int, host: dict[str, dict[str, torch.Tensor]], json_files: dict[str, Any],
               marker: dict[str, Any]) -> StagedStep:
        """Write this rank's files of one step, marker last. The free space is checked first; on any
        failure the files of this attempt are removed (a full disk keeps no partial file) and the
        error is raised: NoSpaceError (naming the path, bytes needed and free) when the disk is full."""
        start = time.perf_counter()
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        # A marker left by an earlier attempt at this step must not vouch for the files rewritten now.
        (step_dir / rank_marker(rank)).unlink(missing_ok=True)
        names = [*host, *json_files, rank_marker(rank)]
        needed = staging_bytes(host, json_files)
        try:
            storage.check_space(str(step_dir), needed, f"staging step {step} (rank {rank})")
            records: dict[str, FileRecord] = {}
            for file, tensors in host.items():
                records[file] = write_safetensors(step_dir / file, tensors)
            for file, value in json_files.items():
                records[file] = write_json(step_dir / file, value)
            write_json(step_dir / rank_marker(rank), {
                **marker, "step": step, "rank": rank, "staged_at": time.time(),
                "files": {name: record.to_json() for name, record in records.items()},
            })
        except BaseException as exc:
            _remove_partial(step_dir, names)
            if storage.is_no_space(exc) and not isinstance(exc, storage.NoSpaceError):
                raise storage.NoSpaceError(str(step_dir), f"staging step {step} (rank {rank})", needed,
                                           storage.free_bytes(str(step_dir)) or 0) from exc
            raise
        total = sum(r.size for r in records.values())
        seconds = time.perf_counter() - start
        log.info("staged step %d (rank %d): %.2f GB in %.1f s", step, rank, total / 1e9, seconds)
        return StagedStep(step=step, path=step_dir, files=records, bytes=total, write_s=seconds)


def staging_bytes(host: dict[str, dict[str, torch.Tensor]], json_files: dict[str, Any]) -> int:
    """Bytes one rank's staging of a step needs: tensor data, a generous bound on each safetensors
    header, the JSON files as write_json writes them, and a filesystem block per file."""
    tensors = sum(t.numel() * t.element_size() + 256 for tensors in host.values() for t in tensors.values())
    text = sum(len(json.dumps(value, indent=1, sort_keys=True)) for value in json_files.values())
    files = len(host) + len(json_files) + 1
    return tensors + text + files * (4096 + 1024)


def _remove_partial(step_dir: Path, names: list[str]) -> None:
    """Remove what a failed staging of these files left (files, temporary ``.name.tmp``), and the
    step dir when nothing else is in it (other ranks may share it)."""
    for name in names:
        for path in (step_dir / name, step_dir / f".{name}.tmp"):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        step_dir.rmdir()  # fails (and is left) when not empty
