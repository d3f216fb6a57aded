"""Measurements taken while a run trains, and the files they go to:

- ``timers``       per-phase step timers (CUDA events on GPU)
- ``startup``      where a rank's start-up time goes (imports, store, groups, model, ... first step)
- ``mfu``          model FLOPs per token and utilisation against the device's peak
- ``straggler``    per-rank step times -> slow ranks and a heat map
- ``metrics``      one row per step to metrics.jsonl, plus TensorBoard / W&B / MLflow sinks
- ``tensorboard``  TensorBoard events without TensorFlow; ``jsonl``: append-only logs that
                   survive a writer killed mid-row
- ``attempt_log``  one attempt's output: every line to files, the meaningful ones to the operator
- ``log_records``  timed in-memory log records (the fault matrix, chaos --ettr)

What an operator reads from these files (status, report, who hung) is ``megatrain/report/``.
"""
