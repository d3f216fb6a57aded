"""The trainer's checkpointer: when to save, what to save, and where uploads happen.

The trainer calls three things (see megatrain/training/trainer.py)::

    step = checkpointer.restore(trainer)   # at start: newest verified committed checkpoint, or 0
    checkpointer.maybe_save(trainer)       # after every step: acts every `interval` steps and at the last
    checkpointer.close()                   # at the end: waits for staging and uploads

With ``checkpoint.memory_interval`` the steps between durable saves are also snapshotted, every
that many steps, into the node's checkpoint keeper (memory.py, keeper.py): a process in host RAM
that outlives the ranks. Restore tries it first (when its step, the same on every rank, is newer
than the newest durable checkpoint and verifies), then the durable store; which tier it came from
and how long it took goes to the log and to ``<run_dir>/restores.jsonl``.

A save blocks the loop only for the device -> host copy (snapshot.py). Staging to local disk runs
in the snapshotter's thread; what happens next depends on ``checkpoint.upload_mode``:

- "thread": each rank's upload thread uploads its own staged files, and rank 0's also commits
  (when every rank's files are durable), applies retention and cleans committed staging dirs;
- "external": nothing is uploaded here. Rank 0's thread writes ``staged.json`` once every rank
  has staged (the Prefect flow then uploads and commits the step as its own task run, see
  ``upload.upload_staged_step``) and applies retention to what the flow has committed.

Either way the next save waits for the previous staging only, never for an upload. A staging,
upload or commit that fails is never swallowed: ``maybe_save`` (every step) raises the error of
any background job that has failed, so the rank fails with it and the step is not reported safe.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatrain import storage
from megatrain.checkpoint import catalog, experts, reshard, state
from megatrain.checkpoint.files import (
    MANIFEST, STAGED, parse_step, rank_marker, rank_meta_file, rank_tensor_file, step_dir_name,
)
from megatrain.checkpoint.memory import MemoryCheckpoints, PeerSettings, restore_from_memory
from megatrain.checkpoint.restore import RunIdentity, StageStart, restore_checkpoint
from megatrain.checkpoint.retention import apply_retention, clean_staging
from megatrain.checkpoint.snapshot import RankSnapshot, Snapshotter, SnapshotTiming
from megatrain.checkpoint.upload import UploadError, mark_staged, upload_checkpoint
from megatrain.config import Config, stage_change
from megatrain.observe.jsonl import open_append
from megatrain.parallel.dims import ProcessGroups
from megatrain.parallel.init import DistEnv
from megatrain.launch.fencing import Fence

log = logging.getLogger("megatrain.checkpoint")
NOTABLE_STALL_S = 0.05  # a memory checkpoint that blocked the loop this long is logged at INFO

# Test-only fault hook: SIGKILL every rank right after this step's checkpoint is committed (a crash,
# not a clean exit: no finally blocks, no flushing), to prove resume from a real crash.
KILL_AFTER_COMMIT_ENV = "MEGATRAIN_TEST_KILL_AFTER_COMMIT"


def library_versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for name in ("deepspeed", "megatrain"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


class Checkpointer:
    def __init__(self, cfg: Config, env: DistEnv, groups: ProcessGroups, tokenizer_sha256: str | None = None):
        self.cfg, self.env, self.groups = cfg, env, groups
        self.ckpt = cfg.checkpoint
        self.identity = RunIdentity.of(cfg, tokenizer_sha256)  # the data's tokenizer: recorded, and checked on restore
        self.fingerprint = self.identity.fingerprint
        self.layout = {"dp": groups.dims.dp, "tp": groups.dims.tp, "pp": groups.dims.pp, "world_size": env.world_size,
                       "zero_stage": cfg.parallel.zero_stage}
        if groups.dims.ep > 1:  # recorded only where it matters: a layout without it is ep=1
            self.layout["ep"] = groups.dims.ep
        self.history: list[dict] = []  # changes of schedule or layout this run's checkpoints went through
        self.snapshotter = Snapshotter(self.ckpt.staging_dir, env.device)
        self._memory_saves = 0
        self.memory = MemoryCheckpoints(self.ckpt.staging_dir, env.rank, env.device,
                                        Path(cfg.train.run_dir) / "logs" / "keeper.log",
                                        self._peer_settings()) if self.ckpt.memory_interval else None
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._jobs: list[Future] = []
        self._versions = library_versions()
        self.last_saved_step: int | None = None
        self.last_timing: SnapshotTiming | None = None
        # the attempt's epoch where the launcher issued one (hosts): uploads and the commit are fenced by it
        self.fence = Fence.from_env(cfg.reliability.redis_url, cfg.run_id)
        kill = os.environ.get(KILL_AFTER_COMMIT_ENV)
        self._kill_after_commit = int(kill) if kill else None

    def _peer_settings(self) -> PeerSettings | None:
        """With several nodes, keepers replicate in a ring by node index and register in the run's
        Redis, else in a folder of the run dir (nodes sharing a file system). The index: the
        launcher's stable MEGATRAIN_NODE where it sets one (c10d rendezvous may hand an agent another
        GROUP_RANK on a relaunch, and the keeper outlives the attempt), else torchrun's GROUP_RANK."""
        nnodes = self.env.world_size // max(self.env.local_world_size, 1)
        if nnodes < 2:
            return None
        node = int(os.environ.get("MEGATRAIN_NODE") or os.environ.get("GROUP_RANK", "0"))
        return PeerSettings.of_run(self.cfg, node, nnodes)

    # ---- restore ------------------------------------------------------------------------------

    def restore(self, trainer: Any) -> int:
        """Load the keeper's copy when it is newer than the durable store and verifies, else the
        newest verified committed checkpoint (or, for a new campaign stage, the previous stage's
        weights and optimizer); returns the step to resume from (0 if none)."""
        self._discard_own_staging()
        if not self.ckpt.resume:
            if self.memory is not None:
                self.memory.drop_after(0)  # a fresh start: older copies are another timeline's
            return 0
        start = time.perf_counter()
        tokenizer = self.identity.tokenizer_sha256
        durable_step = self._newest_durable_step()
        restored, tier = None, "durable"
        if self.memory is not None:
            found = restore_from_memory(trainer, self.memory, self.groups, self.identity, self.layout, durable_step)
            restored, tier = found if found is not None else (None, tier)
            self.memory.drop_after(restored.step if restored is not None else durable_step)
        if restored is None:
            restored = restore_checkpoint(trainer, self.ckpt.durable_url, self.identity, self.layout, self.groups,
                                          tokenizer_sha256=tokenizer)
        if restored is None and self.ckpt.init_from and not self.ckpt.init_from.startswith("hf:"):  # hf: trainer.py
            found = restore_checkpoint(trainer, self.ckpt.init_from, None, self.layout, self.groups, full=False,
                                       tokenizer_sha256=tokenizer, stage=StageStart.of(self.cfg))
            if found is None:
                log.warning("checkpoint.init_from=%s holds no committed checkpoint: starting from scratch",
                            self.ckpt.init_from)
        # Uncommitted durable steps after the newest committed one are redone (or, past a keeper
        # restore, superseded by the next durable save): their stale markers must go either way.
        self._drop_abandoned_steps(min(restored.step, durable_step) if restored is not None else 0)
        if restored is None:
            return 0
        # where a keeper restore's seconds went (listing, drop and cleanup measured < 2 ms together)
        phases = self.memory.last_restore_phases if self.memory is not None and tier != "durable" else {}
        self._record_restore(tier, restored.step, durable_step, time.perf_counter() - start, phases)
        self.history = restored.history
        if restored.history and restored.history[-1]["step"] == restored.step:
            log.warning("resumed step %d with changes: %s", restored.step, restored.history[-1])
        self.last_saved_step = restored.step
        return restored.step

    def _newest_durable_step(self) -> int:
        """The newest committed step in the durable store (0: none), as rank 0 lists it."""
        box = [0]
        if self.groups.rank == 0:
            committed = catalog.committed(self.ckpt.durable_url)
            box[0] = committed[-1].step if committed else 0
        if dist.is_initialized() and self.env.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _record_restore(self, tier: str, step: int, durable_step: int, seconds: float,
                        phases: dict[str, float]) -> None:
        """Say which tier a restore came from and what it cost: the log, and a row for the report."""
        log.info("restored step %d from the %s tier in %.3f s (newest durable step %d)%s", step, tier, seconds,
                 durable_step, "".join(f", {name} {value:.3f}" for name, value in phases.items()))
        if self.groups.rank == 0:
            with open_append(Path(self.cfg.train.run_dir) / "restores.jsonl") as out:
                out.write(json.dumps({"time": time.time(), "tier": tier, "step": step, "durable_step": durable_step,
                                      "seconds": round(seconds, 4), "world_size": self.env.world_size,
                                      **({"phases_s": phases} if phases else {})}) + "\n")

    def _drop_abandoned_steps(self, resumed: int) -> None:
        """Uncommitted steps after the one resumed from were left by an attempt that died before
        committing them. This attempt redoes them, and the committer must not take their stale
        rank markers (an older timeline's, maybe another layout's) for the new ones."""
        if self.groups.rank == 0:
            for info in catalog.list_checkpoints(self.ckpt.durable_url):
                if not info.committed and not info.problem and info.step > resumed:
                    try:
                        storage.rm(info.url, recursive=True)
                        log.info("removed uncommitted step %d of an earlier attempt: %s", info.step, info.url)
                    except OSError as exc:
                        log.warning("could not remove uncommitted step %s: %s", info.url, exc)
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()  # nobody uploads into a step dir before it is gone

    def _discard_own_staging(self) -> None:
        """Staged files of an earlier attempt are either committed already or from a timeline that
        is being redone; left in place, their markers could vouch for files rewritten later.
        (The Prefect flow uploads what was staged before it relaunches the ranks.)"""
        root = Path(self.ckpt.staging_dir)
        if root.is_dir():
            rank, g = self.groups.rank, self.groups
            mine = [rank_tensor_file(rank), rank_meta_file(rank), rank_marker(rank), *experts.weight_files(g)]
            if rank == 0:
                mine.append(STAGED)
            for step_dir in (p for p in root.iterdir() if parse_step(p.name) is not None):
                try:  # ranks sharing the staging dir discard at the same time
                    for name in mine:
                        (step_dir / name).unlink(missing_ok=True)
                    if not any(step_dir.iterdir()):
                        step_dir.rmdir()
                except OSError:
                    pass
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()  # nobody stages anew before everybody has discarded

    # ---- save ---------------------------------------------------------------------------------

    def maybe_save(self, trainer: Any) -> bool:
        """Save when ``trainer.step`` is a multiple of the interval, or the last step; else, on a
        multiple of ``memory_interval``, snapshot into the keeper. First raise the error of any
        staging or upload that has failed since the last call. True: a durable save."""
        self.raise_if_failed()
        step = trainer.step
        if step == self.last_saved_step:
            return False
        if step % self.ckpt.interval == 0 or step >= self.cfg.train.steps:
            self.save(trainer)
            return True
        if self.memory is not None and step % self.ckpt.memory_interval == 0:
            self.save_to_memory(trainer)
        return False

    def save_to_memory(self, trainer: Any) -> SnapshotTiming | None:
        """A RAM checkpoint: the same RankSnapshot as a durable save, copied into the keeper's
        shared memory (the loop waits for that copy only); None when the keeper failed."""
        timing = self.memory.save(self._rank_snapshot(trainer))
        if timing is not None:
            # Saves every few steps: a line each (every rank) was most of what a chaos run's flow and
            # Prefect server handled, on the cores the ranks train on. A stall worth reading, a new
            # slot mapping and every 100th save still say so at INFO.
            self._memory_saves += 1
            notable = timing.allocated or timing.blocked_s >= NOTABLE_STALL_S or self._memory_saves % 100 == 1
            log.log(logging.INFO if notable else logging.DEBUG,
                    "memory checkpoint step %d: loop blocked %.3f s (waiting for the previous seal %.3f s, "
                    "copy %.3f s%s)", trainer.step, timing.blocked_s, timing.wait_s, timing.copy_s,
                    ", slot mapped" if timing.allocated else "")
        return timing

    def save(self, trainer: Any) -> SnapshotTiming:
        step = trainer.step
        staged = self.snapshotter.snapshot(self._rank_snapshot(trainer))
        timing = self.last_timing = self.snapshotter.last_timing
        self.last_saved_step = step
        log.info("checkpoint step %d: loop blocked %.3f s (waiting for the previous staging %.3f s, copy %.3f s%s)",
                 step, timing.blocked_s, timing.wait_s, timing.copy_s, ", buffers allocated" if timing.allocated else "")
        if self.ckpt.upload_mode == "thread":
            self._jobs.append(self._background.submit(self._upload, staged))
        elif self.groups.rank == 0:
            self._jobs.append(self._background.submit(self._mark_staged, staged))
        self._jobs = [job for job in self._jobs if not job.done() or job.exception() is not None]  # keep failures
        if self._kill_after_commit == step:
            self._test_kill_after_commit(step)
        return timing

    def _rank_snapshot(self, trainer: Any) -> RankSnapshot:
        engine, g, rank = trainer.engine, self.groups, self.groups.rank
        optim_tensors, optim_meta = state.optimizer_state(engine.optimizer)
        rng_tensors, rng_meta = state.rng_state(self.env.device)
        loader_state = trainer.loader.state_dict()
        coords = {"pp": g.pp_rank, "dp": g.dp_rank, "tp": g.tp_rank}
        # DP replicas hold the same weights: one copy per (pp, tp) shard (and per EP slice of the experts)
        tensor_files = {rank_tensor_file(rank): {**optim_tensors, **rng_tensors},
                        **experts.model_files(engine.module, g)}
        meta = {
            "step": trainer.step, "rank": rank, "coords": coords, "fingerprint": self.fingerprint,
            "layout": self.layout, "optimizer": optim_meta, "scheduler": state.scheduler_state(engine.lr_scheduler),
            "engine": state.engine_counters(engine), "loader": loader_state, "rng": rng_meta,
            "shards": reshard.param_map(engine.module, engine.optimizer, g.dp_rank),
            "state_fields": self.identity.state, "schedule_fields": self.identity.schedule, "history": self.history,
            "layout_fields": stage_change.layout_fields(self.cfg),  # what a next stage's line names (stage_change.py)
            "tokenizer_sha256": self.identity.tokenizer_sha256,
            # the anomaly detector's windows: the step after a restore is judged as without the restart
            "anomaly": trainer.anomaly.state_dict() if getattr(trainer, "anomaly", None) is not None else None,
        }
        marker = {"fingerprint": self.fingerprint, "layout": self.layout, "coords": coords,
                  "data_position": loader_state, "versions": self._versions,
                  **({"epoch": self.fence.epoch} if self.fence is not None else {})}
        return RankSnapshot(step=trainer.step, rank=rank, tensor_files=tensor_files,
                            json_files={rank_meta_file(rank): meta}, marker=marker)

    # ---- background jobs (one thread, in save order) ------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the error of a finished background job (staging, upload, commit) that failed."""
        self.snapshotter.raise_if_failed()
        for job in self._jobs:
            if job.done() and job.exception() is not None:
                raise job.exception()

    def _retry_options(self) -> dict[str, float]:
        return dict(retries=self.ckpt.upload_retries, backoff_s=self.ckpt.upload_backoff_s,
                    max_backoff_s=self.ckpt.upload_backoff_max_s)

    # A failure in these jobs stays in their future: raise_if_failed() and close() raise it in the
    # training loop (upload_checkpoint has already retried storage errors with backoff).

    def _upload(self, staged_future: Future) -> None:
        staged = staged_future.result()
        is_committer = self.groups.rank == 0
        upload_checkpoint(staged.path, self.ckpt.durable_url, ranks=[self.groups.rank], commit=is_committer,
                          commit_timeout_s=self.ckpt.commit_timeout_s, fence=self.fence, **self._retry_options())
        if is_committer:
            apply_retention(self.ckpt.durable_url, self.ckpt.keep_last, self.ckpt.keep_every)
        clean_staging(self.ckpt.staging_dir, self.ckpt.durable_url)

    def _mark_staged(self, staged_future: Future) -> None:
        staged = staged_future.result()
        if not mark_staged(staged.path, self.env.world_size, self.ckpt.commit_timeout_s):
            raise UploadError(f"{staged.path}: not every rank staged step {staged.step} within "
                              f"{self.ckpt.commit_timeout_s:.0f} s (see the other ranks' errors)")
        apply_retention(self.ckpt.durable_url, self.ckpt.keep_last, self.ckpt.keep_every)

    def _test_kill_after_commit(self, step: int) -> None:
        manifest = storage.join_url(self.ckpt.durable_url, step_dir_name(step), MANIFEST)
        deadline = time.monotonic() + 300
        while not storage.exists(manifest):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{KILL_AFTER_COMMIT_ENV}: {manifest} not committed within 300 s")
            time.sleep(0.05)
        log.warning("%s=%d: killing rank %d with SIGKILL", KILL_AFTER_COMMIT_ENV, step, self.groups.rank)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """Wait for staging and for this rank's background uploads (they retry through outages);
        raise the first error any of them ended in."""
        jobs, self._jobs = self._jobs, []  # raised once: a second close() has nothing left to report
        try:
            if self.memory is not None:  # a finished run's keeper has nothing left to keep: its node's
                finished = self.last_saved_step == self.cfg.train.steps  # first rank ends it
                self.memory.close(shutdown=finished and self.env.local_rank == 0)
                self.memory = None
            self.snapshotter.close()
            for job in jobs:
                job.result()
        finally:
            self._background.shutdown(wait=True)
            if self.fence is not None:
                self.fence.close()
