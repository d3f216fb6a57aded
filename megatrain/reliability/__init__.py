"""Reliability: keep a long pretraining job converging through faults.

- ``heartbeat``   every rank publishes step/phase/loss/throughput from a thread of its own
- ``watcher``     reads the heartbeats: dead, hung, missing and slow ranks
- ``stacks``      SIGUSR1 -> faulthandler stack dumps of live ranks, collected by the watcher
- ``anomaly``     NaN/inf loss, loss spikes, gradient explosions -> a ``Verdict`` file for rollback
- ``faults``      fault injection (off by default) to prove that recovery works
- ``selfcheck``   per-node GEMM, memory, all-reduce, storage and Redis checks -> eviction list
- ``gpu_verdict`` the card's GEMM, copy and all-reduce against its kind's figures (``gpu_expected``)
- ``redis_server`` a temporary loopback Redis for a command-line run

Nothing is imported here: the orchestrator imports ``watcher`` and ``anomaly`` without
loading torch (only ``selfcheck`` needs it).
"""
