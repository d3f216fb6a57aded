"""The operator's view of a campaign, read from its folders alone (no Prefect server, no torch):

- ``runs``       per-run summaries from metrics.jsonl; the loss curve with restart/rollback marks
- ``status``     where a campaign stands (``megatrain status``): stages, steps, loss, faults
- ``campaign``   the campaign's report: stage table, faults with their log files, checkpoints,
                 pictures, samples (markdown for report.md and for the Prefect artifact)
- ``hang_view``  who hung: every rank's last heartbeat drawn in its 3D-parallel place
- ``console``    the one-screen console of a campaign flow, and its closing summary
- ``cli``        ``megatrain report``
"""
