"""The pretraining campaign: validate -> shard data -> self-check -> stages in order -> report.

Rerun a failed or crashed run (the UI's Retry, or a new run of the same campaign) and finished
stages come back from the cache while the interrupted one resumes from its last committed
checkpoint.
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.states import Cancelled, Failed

from flows.lifecycle import campaign_lease, run_from_command_line
from megatrain.lease import LeaseHeld
from tasks.campaign import validate_campaign
from tasks.data import shard_campaign_data
from tasks.report import write_report
from tasks.selfcheck import run_self_check
from tasks.stop import STOP, stop_on_signals
from tasks.train import final_checkpoint_problem, train_stage

DEFAULT_CAMPAIGN = "configs/campaign-local.yaml"


@flow(name="pretrain", log_prints=True)
def pretrain(campaign_path: str = DEFAULT_CAMPAIGN, overrides: list[str] | None = None, lease_wait_s: float = 0.0):
    """Ends Completed with the report only when every stage's final checkpoint is committed and
    verifies; Failed with the cause as its message (a bad campaign, the campaign in use by
    another run, a stage that gave up); Cancelled after SIGTERM, SIGINT or a cancel (the ranks
    stopped within seconds, what was staged committed). ``lease_wait_s``: how long to wait for
    another run of the same campaign to finish (0: refuse at once, naming it)."""
    validated = validate_campaign(campaign_path, overrides or [], return_state=True)
    if not validated.is_completed():
        return _ended(validated)
    campaign = validated.result()
    with stop_on_signals():
        try:
            with campaign_lease(campaign, lease_wait_s):
                return _run_stages(campaign)
        except LeaseHeld as exc:
            return Failed(message=str(exc), data=exc)


def _ended(state):
    """The flow run ends as a task run did (Failed or Cancelled), with its cause as the message."""
    if state.is_cancelled():
        return Cancelled(message=state.message)
    return Failed(message=state.message, data=state.result(raise_on_failure=False))


def _run_stages(campaign):
    shards = shard_campaign_data(campaign)
    if campaign.self_check:
        run_self_check(campaign)
    results, cached = [], 0
    for index in range(len(campaign.stages)):
        if STOP.is_set():
            return Cancelled(message=f"campaign {campaign.id} stopped ({STOP.reason}) before stage "
                                     f"{campaign.stages[index].name}")
        stage = train_stage
        # The cached result of a stage stands only while its final checkpoint still verifies
        # (a deleted run dir, a corrupted file): otherwise the stage trains again.
        problem = final_checkpoint_problem(campaign.stage_durable_url(index), campaign.stages[index].steps)
        if problem:
            stage = train_stage.with_options(refresh_cache=True)
        state = stage(campaign, index, shards[index]["version"], return_state=True)
        if not state.is_completed():
            return _ended(state)
        cached += state.name == "Cached"
        results.append(state.result())
    if cached == len(campaign.stages):
        print(f"campaign {campaign.id} was already finished: every stage's final checkpoint is committed and "
              "verifies; nothing was trained again")
    return write_report(campaign, results)


def print_summary(report: dict) -> None:
    print(f"\ncampaign {report['campaign']} finished")
    for row in report["stages"]:
        print(f"  stage {row['stage']}: {row['steps']} steps, loss {row['first loss']} -> {row['final loss']}, "
              f"{row['tokens/s']} tokens/s, {row['restarts']} restarts, {row['rollbacks']} rollbacks")
    print(f"  checkpoints: {len(report['checkpoints'])} committed, newest {report['checkpoints'][-1]['url'] if report['checkpoints'] else '-'}")
    print(f"  report: {report['report']}\n  loss curve: {report['loss_curve']}")


if __name__ == "__main__":
    sys.exit(run_from_command_line(sys.argv[1:], DEFAULT_CAMPAIGN, print_summary))
