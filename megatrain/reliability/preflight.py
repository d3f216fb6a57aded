"""Preflight: before a rank trains, every location the run will write takes a write and has room.

Found on main: a read-only durable store was noticed only at the first upload (the flow retried
EROFS for minutes; a plain ``megatrain train`` trained every step first). Now the run's three
locations are probed before anything is built, by ``megatrain.storage.probe`` (a uniquely named
file written, read back and deleted; free space of a local filesystem):

==========================  ===============================================================
``train.run_dir``           writable (logs, metrics, heartbeats: no size asked)
``checkpoint.staging_dir``  writable; room for two checkpoints' share of one node (its ranks'
                            files: at least the largest rank's), on that node's local disk
``checkpoint.durable_url``  writable (any fsspec URL); room for two whole checkpoints when local
==========================  ===============================================================

Two, because a checkpoint is written beside the previous one, which retention deletes only
after the new one is committed. Locations on one filesystem must fit there together. The size
of a checkpoint is ``megatrain.parallel.plan.checkpoint_size`` (the figure ``megatrain plan``
prints). A location that is not writable or too small is a deterministic error, one line naming
the location and the bytes; an outage (connection refused) stays a retriable ``StorageError``.

Who runs it: rank 0 of ``megatrain train`` before the process groups, the data and the model (its
peers learn the verdict when it exits), the flow's ``validate-campaign`` for every stage, and the
self-check's storage check (``storage_check``).
"""

from __future__ import annotations

from megatrain import storage
from megatrain.config import Config
from megatrain.parallel.plan import CheckpointSize, checkpoint_size


def targets(cfg: Config, size: CheckpointSize, local: bool = True) -> list[storage.Target]:
    """The locations a run of ``cfg`` writes, each with the bytes it must hold. ``local=False``
    leaves out the run and staging dirs (the flow of a Kubernetes stage cannot see its pods'
    disks: rank 0 probes them there)."""
    durable = storage.Target(cfg.checkpoint.durable_url, "checkpoint.durable_url", 2 * size.total,
                             f"two checkpoints (2 x {size.total} bytes)")
    if not local:
        return [durable]
    return [
        storage.Target(cfg.train.run_dir, "train.run_dir"),
        storage.Target(cfg.checkpoint.staging_dir, "checkpoint.staging_dir", 2 * size.per_node,
                       f"two checkpoints' share of one node (2 x {size.per_node} bytes)"),
        durable,
    ]


def preflight(cfg: Config, world_size: int = 1, ranks_per_node: int | None = None, cuda: bool = True,
              local: bool = True) -> list[storage.ProbeResult]:
    """Probe every location a run of ``cfg`` on ``world_size`` ranks (``ranks_per_node`` to a node)
    writes. ``cuda``: what ``train.dtype: auto`` resolves to (bf16 on a GPU, fp32 on a CPU; bf16
    is the smaller checkpoint, so a caller that cannot know passes True and never refuses a run
    that fits). Raises ``storage.LocationNotWritable``/``LocationTooSmall`` (deterministic) or
    ``storage.StorageError`` (an outage: retriable)."""
    size = checkpoint_size(cfg, world_size, ranks_per_node, cuda=cuda)
    return storage.probe_locations(targets(cfg, size, local))


def storage_check(cfg: Config, url: str, payload_bytes: int) -> storage.ProbeResult:
    """The self-check's storage round trip: the same probe with a payload of ``payload_bytes``
    (its MB/s come from the result), and room for two checkpoints when ``url`` is the run's
    durable store."""
    if url == cfg.checkpoint.durable_url:
        target = targets(cfg, checkpoint_size(cfg, cuda=True), local=False)[0]
    else:
        target = storage.Target(url, "reliability.selfcheck.storage_url")
    return storage.probe_locations([target], payload_bytes)[0]
