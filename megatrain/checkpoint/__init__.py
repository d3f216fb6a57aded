"""Two-stage checkpoints (MegaScale): device -> reused host buffers in about a second, then, in the
background, host -> local staging disk -> durable storage, committed by a manifest written last.

Modules, in the order a checkpoint flows through them:

- ``files``: the format (file names, streaming safetensors writer, checksums)
- ``state``: what a checkpoint holds, taken from and put back into a live trainer
- ``experts``: which rank writes, reads and broadcasts which weights (expert parallelism: one
  file per EP slice of the experts)
- ``snapshot``: stage 1, the only part the training loop waits for
- ``upload``: stage 2, upload + verify + atomic commit (also a Prefect task's engine)
- ``retention``: which committed checkpoints to keep, cleaning staged steps
- ``catalog``: what a durable URL holds; ``restore``: newest verified checkpoint back into a trainer
- ``reshard``: a checkpoint of another layout (dp, tp, pp, ep, ZeRO) into this one; ``names``:
  the canonical tensor names its parameter map keys by
- ``manager``: the ``Checkpointer`` the trainer calls; ``cli``: ``megatrain checkpoints ...``

Which config changes a checkpoint survives is a config policy: ``megatrain/config/compat.py``.
"""
