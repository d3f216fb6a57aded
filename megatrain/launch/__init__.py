"""Launching ranks and keeping one writer per run.

- ``ranks``    the torchrun command; ``run_ranks`` supervises one attempt (heartbeat watcher,
               wall-clock limit, process-group kill, root cause)
- ``standby``  the launcher's side of warm standby: the next attempt's rank processes, imported
               and waiting (their side is ``megatrain/training/standby.py``)
- ``nodes``    N torchrun agents on one machine (nodes x ranks), for elastic campaigns
- ``hosts``    a cluster on one machine: hosts as namespaces on a bridge, up and always down
               (``host_init`` is a host's PID 1; ``cluster_services``: Redis, S3, ``megatrain cluster``)
- ``lease``    one writer per campaign or run dir (a lease file with pid, host, heartbeat)
- ``compile_cache`` where a run's torch.compile caches live (the campaign's or run dir's
               ``compile-cache``), so a restart finds the graphs and kernels compiled before it

Nothing here imports torch: the Prefect tasks launch ranks without loading the engine.
"""
