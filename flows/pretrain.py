"""The pretraining campaign: validate -> shard data -> self-check -> stages in order -> report.

Rerun a failed or crashed run (the UI's Retry, or a new run of the same campaign) and finished
stages come back from the cache while the interrupted one resumes from its last committed
checkpoint.

``campaign_id``: "" keeps the campaign file's id (``id=...`` in ``overrides`` too); "new" (the
``pretrain/local`` deployment's default) starts a fresh campaign named after the file's id and the
flow run (the UI's Retry keeps it); any other id resumes that campaign.
"""

from __future__ import annotations

import argparse
import sys

from prefect import flow
from prefect.events import emit_event
from prefect.states import Cancelled, Completed, Failed

from flows.lifecycle import campaign_lease, run_from_command_line
from flows.shard_data import shard_campaign_data
from megatrain.launch.lease import LeaseHeld
from tasks.campaign import validate_campaign
from tasks.cluster import ClusterUnavailable, campaign_cluster
from tasks.export import export_final_model
from tasks.report import sample_stage, write_report
from tasks.selfcheck import run_self_check
from tasks.stop import STOP, stop_on_signals
from tasks.train import final_checkpoint_problem, train_stage

DEFAULT_CAMPAIGN = "configs/campaign-local.yaml"
EXPORT_PROMPTS = ("def ", "import ", "class ")  # greedy samples from the exported model, by transformers


@flow(name="pretrain", log_prints=True)
def pretrain(campaign_path: str = DEFAULT_CAMPAIGN, overrides: list[str] | None = None, lease_wait_s: float = 0.0,
             campaign_id: str = ""):
    """Ends Completed with the report only when every stage's final checkpoint is committed and
    verifies; Failed with the cause as its message (a bad campaign, the campaign in use by
    another run, a stage that gave up); Cancelled after SIGTERM, SIGINT or a cancel (the ranks
    stopped within seconds, what was staged committed). ``lease_wait_s``: how long to wait for
    another run of the same campaign to finish (0: refuse at once, naming it)."""
    named = with_campaign_id(campaign_path, campaign_id, overrides or [])
    validated = validate_campaign(campaign_path, named, return_state=True)
    if not validated.is_completed():
        return _ended(validated)
    campaign = validated.result()
    finished = _already_finished(campaign_path, named)
    if finished:  # as the command line ends it: no self-check, export or report run again
        print(finished)
        # `prefect deployment run --watch` shows events, not prints: this one says it in words
        emit_event(event="megatrain.campaign.already-finished",
                   resource={"prefect.resource.id": f"megatrain.config.campaign.{campaign.id}",
                             "prefect.resource.name": finished.splitlines()[0]})
        return Completed(message=finished.splitlines()[0])
    with stop_on_signals():
        try:
            # launcher hosts: the campaign's cluster, brought up here and always taken down (tasks/cluster.py)
            with campaign_lease(campaign, lease_wait_s), campaign_cluster(campaign) as on_cluster:
                return _run_stages(on_cluster)
        except (LeaseHeld, ClusterUnavailable) as exc:
            return Failed(message=str(exc), data=exc)


def _already_finished(campaign_path: str, overrides: list[str]) -> str | None:
    """The command line's "already finished" sentence, or None when there is something to run (or
    the records cannot tell: then the stages' caches decide)."""
    from megatrain.report.console import campaign_finished

    try:
        return campaign_finished(campaign_path, overrides)
    except Exception:  # noqa: BLE001 (a torn report or status: the flow runs and rewrites it)
        return None


def _ended(state):
    """The flow run ends as a task run did (Failed or Cancelled), with its cause as the message."""
    if state.is_cancelled():
        return Cancelled(message=state.message)
    return Failed(message=state.message, data=state.result(raise_on_failure=False))


def _cached_failure(state) -> bool:
    """A stage "completed from the cache" whose cached result is the error an earlier run failed
    with (for Prefect a task that returns its Failed state has finished, and it caches the state's
    data): the stage must run, and fail or succeed, again. Seen as a rerun that reported the
    campaign finished and then crashed writing the report."""
    if state.name != "Cached":
        return False
    try:
        return isinstance(state.result(raise_on_failure=False), BaseException)
    except Exception:  # noqa: BLE001 (a record that cannot be read back is no result either)
        return True


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
        if _cached_failure(state):  # Prefect keeps a returned Failed state's data as the cache record
            state = train_stage.with_options(refresh_cache=True)(campaign, index, shards[index]["version"],
                                                                 return_state=True)
        if not state.is_completed():
            return _ended(state)
        cached += state.name == "Cached"
        results.append(state.result())
        if campaign.samples:  # observability: a failed sampling is shown red and noted in the report, training stands
            sample_stage(results[-1]["run_dir"], campaign.samples, return_state=True)
    if cached == len(campaign.stages):
        print(f"campaign {campaign.id} was already finished: every stage's final checkpoint is committed and "
              "verifies; nothing was trained again")
    if campaign.export:  # a model people can load; a failed export is shown red and noted, training stands
        export_final_model(results[-1]["run_dir"], str(campaign.campaign_dir / "model"), list(EXPORT_PROMPTS),
                           return_state=True)
    return write_report(campaign, results)


def with_campaign_id(campaign_path: str, campaign_id: str, overrides: list[str]) -> list[str]:
    """The overrides that name the campaign: "" the file's, "new" a fresh one, else that one."""
    if not campaign_id:
        return list(overrides)
    if campaign_id == "new":
        from uuid import uuid4

        from prefect.runtime import flow_run

        from megatrain.config import read_yaml

        base = read_yaml(campaign_path).get("id", "campaign")
        campaign_id = f"{base}-{str(flow_run.id or uuid4())[:8]}"  # the flow run's id: stable over Retry
        print(f"campaign id {campaign_id} (resume it with campaign_id={campaign_id})")
    return [*overrides, f"id={campaign_id}"]


def print_summary(report: dict) -> None:
    """What `make demo` ends with: one screen, every path an operator looks for next."""
    from megatrain.report.console import summary_lines

    print("\n".join(summary_lines(report)))


def main(argv: list[str] | None = None) -> int:
    """The command line, under megatrain's one error path (``megatrain/cli.py``): a bad campaign
    is one line naming the file and field (exit 2), Ctrl-C one line (exit 130), a bug one line
    naming the file that holds its traceback (exit 70)."""
    from megatrain.cli import run_command

    return run_command("python -m flows.pretrain", _main, sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flows.pretrain",
        description="Run a pretraining campaign (validate, shard, self-check, stages, report) as a Prefect "
                    "flow. Rerunning the same id resumes it: finished stages come from the cache.")
    parser.add_argument("campaign_path", nargs="?", default=DEFAULT_CAMPAIGN, help=f"campaign YAML (default {DEFAULT_CAMPAIGN})")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="campaign fields, e.g. id=my-run (a new id is a new campaign, an old one resumes it)")
    parser.add_argument("--verbose", action="store_true", help="show every rank line on the console (the files have them anyway)")
    args = parser.parse_args(argv)

    from megatrain.config.campaign import load_campaign
    from megatrain.report.console import quiet_console

    load_campaign(args.campaign_path, args.overrides)  # a bad campaign raises, before any server starts
    finished = _already_finished(args.campaign_path, args.overrides)
    if finished:
        print(finished)
        return 0
    if not args.verbose:
        quiet_console()
    return run_from_command_line(pretrain, [args.campaign_path, *args.overrides], DEFAULT_CAMPAIGN, print_summary)


if __name__ == "__main__":
    from megatrain.launch.process_exit import exit_after_handlers

    exit_after_handlers(main())  # seconds sooner than sys.exit: no teardown of torch and Prefect
