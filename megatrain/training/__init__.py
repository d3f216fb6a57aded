"""Training: one rank's life and the loop it runs.

- ``rank``     the entry point of a rank (``python -m megatrain.train``): config, run-dir lease,
               process groups, the trainer, the exit code the launcher reads
- ``trainer``  builds the parts of a run in order, then ``train_step()`` steps them
- ``standby``  a warm standby process: imports ahead of a restart, then becomes a rank
"""
