"""A rank's side of RAM checkpoints: save into the node's keeper, and restore from it.

The keeper (keeper.py) is found by a folder derived from the node's staging dir, so every rank
of a node, and every attempt of a run, reaches the same one (keeper_control.py). The campaign
flow starts one per node before a stage; a rank that finds none starts it, detached
(``keeper_control.start_keeper``); the run's last save shuts it down, and the flow stops what is
left at the stage's end.

Save (``MemoryCheckpoints.save``, on the training thread): wait for the previous seal, ask the
keeper for its spare slot, copy every tensor from the device straight into that shared memory
(the only copy: the keeper holds these very bytes), then seal it in a background thread while
training goes on. Memory checkpoints are best effort: a keeper that is gone costs a warning, and
the next save starts a new keeper; the durable checkpoints guard the run as before.

Restore (``restore_from_memory``, every rank together): each rank names the steps its keeper holds
for it; the newest step that every rank holds, and newer than the newest durable checkpoint, is
read back and checked (sha256 of every chunk and of the JSON, written by the same config and
layout); if any rank finds a problem, all ranks try the next older common step, then give up
(the caller restores from the durable store). On a GPU with room for a second copy of the state,
the bytes go to the device in chunks while every chunk's sha256 runs on the host's cores
(device_stage.py), and restore's copies are device to device. Tiers, in order: a rank reads its
step from its own keeper, else from a peer node's keeper that holds a replica of it
(keeper_peer.py; a lost node's ranks have only that), and the restore says ``peer`` when any rank
used one. ZeRO partitions,
RNG, the LR schedule and the data position come back through ``restore.apply_rank_state``, as from a durable checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from megatrain.checkpoint.experts import read_weights
from megatrain.checkpoint.files import ChecksumError, rank_meta_file, rank_tensor_file
from megatrain.checkpoint.keeper_control import (  # noqa: F401  (KEEPER_*_ENV, keeper_dir: re-exported)
    KEEPER_IDLE_ENV,
    KEEPER_ROOT_ENV,
    KeeperClient,
    KeeperError,
    KeeperTimeout,
    PeerSettings,
    keeper_dir,
)
from megatrain.checkpoint.keeper_peer import PeerClient, PeerError, Registry
from megatrain.checkpoint.device_stage import fits_on_device, pin, stage_on_device, unpin
from megatrain.checkpoint.keeper_wire import chunk_hashes_started, text_hash
from megatrain.checkpoint.restore import RankState, Restored, RunIdentity, _gather, apply_rank_state, same_layout
from megatrain.checkpoint.snapshot import RankSnapshot, SnapshotTiming
from megatrain.launch.run_token import run_token
from megatrain.parallel.dims import ProcessGroups

log = logging.getLogger("megatrain.checkpoint")

ALIGN = 64
SMALL = 1 << 20  # tensors under this many bytes are read from the host copy even when it is staged on the GPU
SILENCE_FIRST_S, SILENCE_MAX_S = 60.0, 600.0  # a keeper that timed out is left alone this long, then longer


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The keeper's shared memory as a uint8 tensor (MAP_SHARED: our writes are the keeper's bytes)."""
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.close(fd)


def _received(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A buffer a peer's copy is received into: a tensor of our own (no second copy at restore)."""
    buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buffer, memoryview(buffer.numpy())


def _dtype(name: str) -> torch.dtype:
    """A dtype by its str() (the keeper's records are JSON), never any other attribute of torch."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise KeyError(f"unknown dtype {name!r}")


def _nbytes(entry: list) -> int:
    _, _, dtype, shape, _ = entry
    count = 1
    for size in shape:
        count *= size
    return count * _dtype(dtype).itemsize


def _view(buffer: torch.Tensor, entry: list) -> torch.Tensor:
    """The tensor an entry names. The entries are the keeper's records, outside the checksums: one
    that points past the copy is a ValueError (the restore takes the next tier), not a crash that
    every restart would repeat."""
    _, name, dtype, shape, offset = entry
    nbytes = _nbytes(entry)
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"keeper entry {name!r}: bytes {offset}..+{nbytes} outside the copy of {buffer.numel()}")
    return buffer[offset:offset + nbytes].view(_dtype(dtype)).view(shape)


class MemoryCheckpoints:
    """One rank's RAM checkpoints in its node's keeper."""

    def __init__(self, staging_dir: str | Path, rank: int, device: torch.device, log_path: Path,
                 peer: PeerSettings | None = None):
        self.folder, self.rank, self.device, self.log_path = keeper_dir(staging_dir), rank, device, log_path
        self.peer, token = peer, run_token()
        self.peers = PeerClient(Registry(peer.registry, peer.run_id), peer.node, token) if peer and token else None
        self._client: KeeperClient | None = None
        self._maps: dict[str, torch.Tensor] = {}  # slot id -> mapping, reused while the keeper keeps the slot
        self._pinned: set[str] = set()  # slot ids whose mapping is registered with CUDA (device_stage.pin)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-seal")
        self._pending: Future | None = None
        self.last_timing: SnapshotTiming | None = None
        self.last_restore_phases: dict[str, float] = {}  # the last restore_from_memory's seconds by phase
        # A keeper that did not answer in time (stopped, wedged) is not asked again before this
        # (time.monotonic()); the pause doubles with every timeout, so a save waits on it rarely.
        self._silent_until, self._silence_s, self._silent_why = 0.0, SILENCE_FIRST_S, ""

    def client(self, start: bool = True) -> KeeperClient:
        """The connection to the node's keeper (``start``: start one when none answers)."""
        if time.monotonic() < self._silent_until:
            raise KeeperTimeout(f"{self._silent_why}; not asked again for {self._silent_until - time.monotonic():.0f} s")
        if self._client is None:
            self._client = KeeperClient.connect(self.folder, start_log=self.log_path if start else None, peer=self.peer)
        return self._client

    def _failed(self, exc: KeeperError) -> None:
        """After a failed request: forget the connection; after a timeout, leave the keeper alone a while."""
        if isinstance(exc, KeeperTimeout) and time.monotonic() >= self._silent_until:
            self._silent_why = str(exc).split("; not asked again")[0]
            self._silent_until = time.monotonic() + self._silence_s
            self._silence_s = min(2 * self._silence_s, SILENCE_MAX_S)
        self._reset()

    def _reset(self) -> None:
        """Forget the connection and mappings (the keeper died: a new one has new slots)."""
        if self._client is not None:
            self._client.close()
        for slot_id in list(self._maps):
            self._forget(slot_id)
        self._client = None

    def _keep_mapping(self, slot_id: str, buffer: torch.Tensor) -> torch.Tensor:
        """Cache a slot's mapping for the next saves into it (the keeper has two slots per rank, so
        a third mapping means the oldest slot is gone)."""
        self._maps[slot_id] = buffer
        while len(self._maps) > 2:
            self._forget(next(iter(self._maps)))
        return buffer

    def _forget(self, slot_id: str) -> None:
        """Drop one slot's mapping (unregistered from CUDA first: the memory is unmapped with it)."""
        buffer = self._maps.pop(slot_id)
        if slot_id in self._pinned:
            self._pinned.discard(slot_id)
            if self._stream is not None:
                self._stream.synchronize()  # no copy may still be reading or writing it
            unpin(buffer)

    # ---- save ---------------------------------------------------------------------------------

    def save(self, snap: RankSnapshot) -> SnapshotTiming | None:
        """Copy ``snap`` into the keeper; None (and a warning) when the keeper failed."""
        start = time.perf_counter()
        try:
            self.wait()
            waited = time.perf_counter()
            entries, used = [], 0
            for file, tensors in snap.tensor_files.items():
                for name, tensor in tensors.items():
                    entries.append([file, name, str(tensor.dtype), list(tensor.shape), used])
                    nbytes = tensor.numel() * tensor.element_size()
                    used += nbytes + (-nbytes % ALIGN)
            reply, fds = self.client().request("alloc", rank=self.rank, nbytes=used)
            buffer = self._maps.get(reply["id"])
            allocated = buffer is None  # the first save into this slot maps it; later ones reuse the mapping
            if allocated:
                buffer = self._keep_mapping(reply["id"], _map(fds[0], used))
            else:
                os.close(fds[0])
            if self.device.type == "cuda" and reply["id"] not in self._pinned and pin(buffer):
                self._pinned.add(reply["id"])  # once per slot: every later copy into it is DMA
            self._copy(buffer, snap.tensor_files, entries)
            text = json.dumps(snap.json_files)
        except (KeeperError, OSError) as exc:
            silent = time.monotonic() < self._silent_until
            log.log(logging.DEBUG if silent and isinstance(exc, KeeperTimeout) else logging.WARNING,
                    "memory checkpoint of step %d failed (%s); the next one starts a new keeper", snap.step, exc)
            if isinstance(exc, KeeperError):
                self._failed(exc)
            else:
                self._reset()
            return None
        self.last_timing = SnapshotTiming(wait_s=waited - start, copy_s=time.perf_counter() - waited, allocated=allocated)
        self._pending = self._sealer.submit(self.client().request, "seal", rank=self.rank, slot=reply["slot"],
                                            step=snap.step, used=used, entries=entries, json=text,
                                            json_sha256=text_hash(text))
        return self.last_timing

    def _copy(self, buffer: torch.Tensor, tensor_files: dict[str, dict[str, torch.Tensor]], entries: list) -> None:
        views = iter(entries)
        if self._stream is not None:  # as snapshot.py: the copy sees the finished optimizer step
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for tensors in tensor_files.values():
                for tensor in tensors.values():
                    _view(buffer, next(views)).copy_(tensor, non_blocking=tensor.is_cuda)
        if self._stream is not None:
            self._stream.synchronize()

    def wait(self) -> None:
        """Wait for the last seal (its slot is not the spare until it is sealed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ---- restore ------------------------------------------------------------------------------

    def held_steps(self) -> list[int]:
        """The steps this rank's keeper holds sealed for it (none when no keeper answers)."""
        try:
            reply, _ = self.client(start=False).request("list")
        except KeeperError as exc:
            if isinstance(exc, KeeperTimeout):  # no answer is no copy: the restore takes the next tier
                log.warning("rank %d: keeper not asked for its copies: %s", self.rank, exc)
            self._failed(exc)
            return []
        return sorted(entry["step"] for entry in reply["ranks"].get(str(self.rank), []))

    def peer_steps(self) -> dict[int, str]:
        """step -> address of a peer keeper holding a replica of this rank's copy (none: no peers)."""
        try:
            return self.peers.held(self.rank) if self.peers is not None else {}
        except (PeerError, OSError, ValueError) as exc:  # the registry itself unreadable
            log.warning("peer keepers not asked: %s", exc)
            return {}

    def fetch(self, step: int, peer: str | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """This rank's copy of ``step`` (tensor files, JSON files) from its keeper, or with ``peer``
        from that peer keeper's replica; every chunk's sha256 and the JSON's checked first;
        ChecksumError when a check fails."""
        if peer is None:
            try:
                reply, fds = self.client().request("get", rank=self.rank, step=step)
            except KeeperError as exc:
                self._failed(exc)
                raise
            # The restore's mapping stays as the slot's mapping: unmapping an 18 GB one at the end of
            # the restore costs a fraction of a second, and a save into this slot reuses it anyway.
            buffer, where = self._maps.get(reply.get("id")), "keeper"
            if buffer is not None:  # this process saved into the slot: it is mapped already
                os.close(fds[0])
            else:
                buffer = _map(fds[0], reply["nbytes"])
                if "id" in reply:
                    self._keep_mapping(reply["id"], buffer)
        else:
            reply, buffer = self.peers.fetch(peer, self.rank, step, _received)
            where = f"peer keeper {peer}"
        used, started = reply["used"], time.perf_counter()
        hashing = chunk_hashes_started(memoryview(buffer.numpy()), used)
        # On a GPU with room for it, the bytes go to the device while the chunks hash (device_stage.py)
        staged = stage_on_device(buffer, used, self.device) if fits_on_device(used, self.device) else None
        copied = time.perf_counter()
        bad = [i for i, (future, b) in enumerate(zip(hashing, reply["chunks"], strict=True)) if future.result() != b]
        self.last_restore_phases = {"stage_s": round(copied - started, 4) if staged is not None else 0.0,
                                    "hash_s": round(time.perf_counter() - started, 4)}
        if bad:
            raise ChecksumError(f"{where} copy of step {step} (rank {self.rank}): sha256 of chunk(s) {bad} differs")
        if text_hash(reply["json"]) != reply["json_sha256"]:
            raise ChecksumError(f"{where} copy of step {step} (rank {self.rank}): its JSON's sha256 differs")
        files: dict[str, dict[str, torch.Tensor]] = {}
        for entry in reply["entries"]:
            # Views, not clones: restore copies each tensor into the model and optimizer before any
            # save can rewrite a keeper's slot, and one more host copy of an 18 GB state cost seconds.
            # (Restores from views died of SIGSEGV before: torch.set_rng_state given a view at an
            # offset crashes, so state.load_rng_state clones the RNG tensors.) Small tensors (RNG
            # states, counters) stay host views: the CPU generator takes only a host tensor.
            large = staged is not None and _nbytes(entry) >= SMALL
            files.setdefault(entry[0], {})[entry[1]] = _view(staged if large else buffer, entry)
        return files, json.loads(reply["json"])

    def read(self, step: int, groups: ProcessGroups, identity: RunIdentity, layout: dict[str, Any],
             peer: str | None = None) -> RankState:
        """This rank's verified copy of ``step`` as restore puts it back, if this run wrote it."""
        files, json_files = self.fetch(step, peer)
        meta = json_files[rank_meta_file(self.rank)]
        if meta.get("step") != step or meta.get("rank") != self.rank:
            raise ChecksumError(f"keeper copy of step {step}: records step {meta.get('step')} rank {meta.get('rank')}")
        if meta.get("fingerprint") != identity.fingerprint or not same_layout(meta.get("layout", {}), layout) \
                or meta.get("tokenizer_sha256") != identity.tokenizer_sha256:
            raise ValueError(f"keeper copy of step {step} was written by another config, layout or tokenizer")
        model = read_weights(groups, files.__getitem__)  # its model files (under EP: its experts' too)
        return RankState(model=model, tensors=files[rank_tensor_file(self.rank)], meta=meta)

    def drop_after(self, step: int) -> None:
        """Forget copies newer than ``step``: they belong to a timeline this attempt does not continue."""
        try:
            dropped = self.client(start=False).request("drop", rank=self.rank, after_step=step)[0]["dropped"]
        except KeeperError as exc:
            self._failed(exc)
            dropped = []
        if self.peers is not None:  # replicas of an abandoned timeline must not outlive it either
            dropped += self.peers.drop(self.rank, step)
        if dropped:
            log.info("keeper: dropped rank %d's copies of steps %s (newer than step %d)", self.rank, dropped, step)

    # ---- end ----------------------------------------------------------------------------------

    def close(self, shutdown: bool = False) -> None:
        """Wait for the last seal; with ``shutdown`` (the run is finished), end the keeper too."""
        try:
            self.wait()
            if shutdown and self._client is not None:
                self._client.request("shutdown")
        except KeeperError as exc:
            log.warning("checkpoint keeper at close: %s", exc)
        finally:
            self._sealer.shutdown(wait=True)
            self._reset()


def read_newest(memory: MemoryCheckpoints, step: int, local: list[int], peer: dict[int, str],
                groups: ProcessGroups, identity: RunIdentity, layout: dict[str, Any]) -> tuple[RankState | None, str]:
    """This rank's copy of ``step``: its keeper's first, else a peer's replica; (state, tier) or
    (None, what was wrong with each)."""
    sources = ([None] if step in local else []) + ([peer[step]] if step in peer else [])
    problems = []
    for source in sources:
        try:
            found = memory.read(step, groups, identity, layout, source), "keeper" if source is None else "peer"
        except (ChecksumError, KeeperError, PeerError, OSError, ValueError, KeyError) as exc:
            problems.append(f"{'keeper' if source is None else 'peer ' + source}: {type(exc).__name__}: {exc}")
            continue
        if problems:  # a copy refused on the way says so even when the next tier stood in
            log.warning("rank %d step %d: %s; read from the %s tier instead", memory.rank, step, "; ".join(problems),
                        found[1])
        return found
    return None, "; ".join(problems) or "no copy"


def restore_from_memory(trainer: Any, memory: MemoryCheckpoints, groups: ProcessGroups, identity: RunIdentity,
                        layout: dict[str, Any], newer_than: int) -> tuple[Restored, str] | None:
    """Every rank together: put back the newest step that every rank's keeper, or a peer's replica
    of it, holds, verified and newer than ``newer_than`` (the newest durable step). Returns it and
    the tier (``keeper``; ``peer`` when any rank read a peer's replica); None: the caller uses the
    durable store."""
    asked = time.perf_counter()
    local, peer = memory.held_steps(), memory.peer_steps()
    held = _gather(sorted(set(local) | set(peer)))
    common = set(held[0]).intersection(*held[1:])
    for step in sorted((s for s in common if s > newer_than), reverse=True):
        started = time.perf_counter()
        rank_state, tier = read_newest(memory, step, local, peer, groups, identity, layout)
        read = time.perf_counter()
        outcomes = _gather((tier, rank_state is not None))
        problems = [(r, t) for r, (t, ok) in enumerate(outcomes) if not ok]
        if problems:
            log.warning("keeper copies of step %d rejected: %s", step, "; ".join(f"rank {r}: {p}" for r, p in problems))
            continue
        phases = {"held_steps_s": round(started - asked, 4), "read_verify_s": round(read - started, 4),
                  **memory.last_restore_phases,
                  "agree_s": round(time.perf_counter() - read, 4)}
        apply_rank_state(trainer, rank_state, groups, full=True, schedule_changed=False, seconds=phases)
        history = rank_state.meta.get("history", [])
        # The staged device copy goes back to torch's allocator with rank_state, not to the driver:
        # the training steps reuse the block, and cudaFree of the 1.3B state took 1.1 s on an H200.
        memory.last_restore_phases = phases
        return Restored(step, history), "peer" if any(t == "peer" for t, _ in outcomes) else "keeper"
    if any(held):
        log.info("keeper copies (steps per rank, own keeper or peer %s) not used: none common to every rank, verified "
                 "and newer than durable step %d", held, newer_than)
    return None
