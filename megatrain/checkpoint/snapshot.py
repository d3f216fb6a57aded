"""Stage 1: device -> reused host buffers (the only part the training loop waits for) -> local disk.

``Snapshotter.snapshot`` does, on the training thread:

1. wait until the previous snapshot's staging write has finished (its buffers are about to be
   reused; the *upload* of that snapshot is not waited for);
2. copy every tensor into a host buffer allocated once, at the first save, and reused after:
   allocating and pinning 16 GB takes 5-7 s on an H200 host, copying into ready pinned memory
   0.3 s. Buffers are pinned only when CUDA exists (pinning is meaningless, and slow, without);
3. on a GPU, issue the copies on a side CUDA stream that first waits for the compute stream (so it
   sees the finished optimizer step), and synchronise only that stream before returning.

Then a background thread writes the buffers to ``<staging_dir>/step-XXXXXXXX/`` (safetensors +
JSON, hashed while written) and writes this rank's ``rank-XXXXX.done.json`` marker last. Training
resumes as soon as step 3 returns; the next optimizer step may overwrite the device tensors because
the host copy is already complete.
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


class Snapshotter:
    """Owns the reusable host buffers and the staging thread of one rank."""

    def __init__(self, staging_dir: str | Path, device: torch.device):
        self.staging_dir = Path(staging_dir)
        self.device = device
        self._pin = torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
        self._pending: Future | None = None
        self.last_timing: SnapshotTiming | None = None

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
        """Block until the last staging write is done (its errors are logged, not raised: a failed
        staging loses one checkpoint, never the run)."""
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:
                log.exception("staging of a checkpoint failed")
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._writer.shutdown(wait=True)

    def _buffer(self, key: tuple[str, str], like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        buf = self._buffers.get(key)
        if buf is not None and buf.shape == like.shape and buf.dtype == like.dtype:
            return buf, False
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)
        self._buffers[key] = buf
        return buf, True

    def _copy_to_host(self, tensor_files: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, dict[str, torch.Tensor]], bool]:
        host: dict[str, dict[str, torch.Tensor]] = {}
        allocated = False
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for file, tensors in tensor_files.items():
                host[file] = {}
                for name, tensor in tensors.items():
                    buf, new = self._buffer((file, name), tensor)
                    allocated |= new
                    buf.copy_(tensor, non_blocking=tensor.is_cuda)
                    host[file][name] = buf
        if self._stream is not None:
            self._stream.synchronize()  # only the copy stream: compute keeps running
        return host, allocated

    def _write(self, step: int, rank: int, host: dict[str, dict[str, torch.Tensor]], json_files: dict[str, Any],
               marker: dict[str, Any]) -> StagedStep:
        start = time.perf_counter()
        step_dir = self.step_dir(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        # A marker left by an earlier attempt at this step must not vouch for the files rewritten now.
        (step_dir / rank_marker(rank)).unlink(missing_ok=True)
        records: dict[str, FileRecord] = {}
        for file, tensors in host.items():
            records[file] = write_safetensors(step_dir / file, tensors)
        for file, value in json_files.items():
            records[file] = write_json(step_dir / file, value)
        write_json(step_dir / rank_marker(rank), {
            **marker, "step": step, "rank": rank, "staged_at": time.time(),
            "files": {name: record.to_json() for name, record in records.items()},
        })
        total = sum(r.size for r in records.values())
        seconds = time.perf_counter() - start
        log.info("staged step %d (rank %d): %.2f GB in %.1f s", step, rank, total / 1e9, seconds)
        return StagedStep(step=step, path=step_dir, files=records, bytes=total, write_s=seconds)

