"""What a campaign run holds while it runs, and lets go of when it ends, however it ends.

- the campaign lease (``megatrain.launch.lease``): one writer per campaign, taken before anything is
  written; a stale one (its flow process died) is taken over, and that flow run, left RUNNING by
  its dead process, is marked Crashed;
- the temporary Prefect server of a command-line run, started here so that it dies with this
  process (PR_SET_PDEATHSIG), even after SIGKILL, instead of Prefect's own, which is orphaned;
- the command line's exit: one line for a bad campaign (before any server starts), one line
  for a failed or stopped run, and an exit code that says which.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

from megatrain.config.campaign import CampaignConfig, stage_config
from megatrain.launch.lease import Lease, lease_store
from tasks._log import run_logger
from tasks.stop import STOP

LEASE_STALE_S = 120.0  # a lease whose heartbeat is older (and whose pid we cannot check) is free
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@contextlib.contextmanager
def campaign_lease(campaign: CampaignConfig, wait_s: float = 0.0) -> Iterator[Lease]:
    """Hold the campaign's lease (raises ``LeaseHeld`` naming the owner). Losing it (another run
    took it over while this one was frozen) stops this run."""
    from prefect.runtime import flow_run

    logger = run_logger()
    redis_url = stage_config(campaign, 0).reliability.redis_url
    store = lease_store(campaign.campaign_dir, f"campaign-{campaign.id}", redis_url, LEASE_STALE_S)
    owner = f"flow run {flow_run.get_name()} ({flow_run.get_id()}) of campaign {campaign.id}"
    lease = Lease(store, owner, stale_after_s=LEASE_STALE_S, wait_s=wait_s, log=logger.warning,
                  on_lost=lambda holder: STOP.request(f"campaign lease lost to {holder}"))
    with lease:
        if lease.took_over is not None:
            _mark_crashed(lease.took_over.owner, f"its process ({lease.took_over.pid} on {lease.took_over.host}) "
                                                 f"died; campaign taken over by {owner}")
        yield lease


def _mark_crashed(owner: str, message: str) -> None:
    """The flow run named in a stale lease, if still RUNNING (its process was killed), becomes
    Crashed: the UI then shows what happened instead of a run that never ends."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    found = _UUID.search(owner)
    if found is None:
        return
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(found.group(0))
            if run.state is not None and run.state.is_running():
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                run_logger().warning("flow run %s marked Crashed: %s", run.name, message)
    except Exception as exc:  # another server's run, or none: nothing to mark
        run_logger().info("stale lease owner %s not marked Crashed (%s)", owner, exc)


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """A temporary local Prefect server that dies with this process, when no API is configured
    (a configured one, e.g. ``make serve``'s, is used as it is)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return

    class ServerDyingWithUs(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            from megatrain.launch.ranks import die_with_parent

            real_popen = subprocess.Popen

            def popen(*args, **kwargs):  # Prefect's own command line, plus PR_SET_PDEATHSIG
                return real_popen(*args, preexec_fn=die_with_parent, **kwargs)

            subprocess.Popen = popen
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = real_popen

    server = ServerDyingWithUs()
    # Prefect's default (20 s) is too short on 2 busy cores (NOTES.md: 60)
    server.start(timeout=max(60, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:  # send the last logs and events while the server still listens (else
                _drain_to_api()  # Prefect's exit-time drain retries a dead server for a minute)
    finally:
        server.stop()


def _drain_to_api(timeout_s: float = 15.0) -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def run_from_command_line(campaign_flow: Callable, argv: list[str], default_campaign: str,
                          show: Callable[[dict], None]) -> int:
    """``python -m flows.pretrain [campaign.yaml] [key=value ...]`` runs ``campaign_flow`` (the
    ``pretrain`` flow, called ``(path, overrides)``) under a temporary server: 0 when every stage is
    durable; 2 for a bad campaign (one line, nothing started); 130/143 after SIGINT/SIGTERM
    (the ranks stopped, what was staged committed); 1 otherwise, with the cause in one line."""
    from megatrain.config.campaign import load_campaign
    from megatrain.errors import DeterministicError
    from megatrain.config import ConfigError

    path, overrides = (argv[0] if argv else default_campaign), argv[1:]
    try:
        campaign = load_campaign(path, overrides)
        from tasks.campaign import check_inputs

        check_inputs(campaign)
    except (ConfigError, DeterministicError, OSError) as exc:
        print(f"megatrain: {exc}", file=sys.stderr)
        return 2
    with temporary_server():
        state = campaign_flow(path, overrides, return_state=True)
    if state.is_completed():
        show(state.result())
        return 0
    print(f"megatrain: campaign {campaign.id} {state.name.lower()}: {state.message}", file=sys.stderr)
    codes = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
    return codes.get(STOP.reason, 1) if state.is_cancelled() else 1

