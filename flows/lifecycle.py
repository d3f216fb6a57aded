"""What a campaign run holds while it runs, and lets go of when it ends, however it ends.

- the campaign lease (``megatrain.launch.lease``): one writer per campaign, taken before anything is
  written; a stale one (its flow process died) is taken over, and that flow run, left RUNNING by
  its dead process, is marked Crashed;
- the temporary Prefect server of a command-line run, started here so that it dies with this
  process (PR_SET_PDEATHSIG), even after SIGKILL, instead of Prefect's own, which is orphaned,
  and with a database of its own, so that runs side by side never share one SQLite file;
- the command line's exit: one line for a bad campaign (before any server starts), one line
  for a failed or stopped run, and an exit code that says which.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

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
    from prefect.exceptions import ObjectNotFound
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
    except ObjectNotFound:  # a command-line run's flow run went with its temporary server
        run_logger().info("stale lease owner %s not marked Crashed: its flow run is not on this server", owner)
    except Exception as exc:  # no server to ask: nothing to mark
        run_logger().info("stale lease owner %s not marked Crashed (%s: %s)", owner, type(exc).__name__, exc)


def _server_environment() -> dict[str, str]:
    """What a command-line run's temporary server gets on top of Prefect's own environment: its
    own ``PREFECT_HOME`` (a new folder; see ``temporary_server``) unless the user said where
    Prefect keeps its state (``PREFECT_HOME`` or the database URL, in the environment, a .env or
    prefect.toml file or a profile), and no telemetry unless the user asked for it: its heartbeat
    reads, then writes, the database while the server's other services start, and on busy cores
    SQLite refuses that upgrade at once ("database is locked", a traceback on the run's console;
    seen once in three runs side by side, with a database each). ``make`` turns it off too."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    extra = {}
    if "home" not in settings.model_fields_set and "connection_url" not in settings.server.database.model_fields_set:
        extra["PREFECT_HOME"] = _own_state_dir()
    if "analytics_enabled" not in settings.server.model_fields_set:
        extra["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return extra


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """A temporary local Prefect server that dies with this process, when no API is configured
    (a configured one, e.g. ``make serve``'s, is used as it is).

    Its state is this run's own: ``PREFECT_HOME`` (hence its SQLite database) is a folder made
    for it and removed after it. Two command-line campaigns at once used to start two servers on
    the one ``~/.prefect/prefect.db`` (one printed a "database is locked" traceback). A temp
    folder rather than one under the campaign dir: a second run of the same campaign (refused by
    the campaign lease, but only once its server is up) would share that one too, and a campaign
    dir may sit on a network file system, where SQLite's locks are not to be trusted. Nothing
    reads a temporary server's history after its run (the campaign's files are the record); only
    the server moves: results, and so the cache of finished stages, stay in the user's Prefect
    home. A ``PREFECT_HOME`` or database URL the user set is theirs, used as it is (runs side by
    side then share it: their choice)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    extra_env = _server_environment()

    class ServerDyingWithUs(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            from megatrain.launch.ranks import die_with_parent

            real_popen = subprocess.Popen

            def popen(*args, env=None, **kwargs):  # Prefect's own command line, plus PR_SET_PDEATHSIG
                env = {**(env or os.environ), **extra_env}  # and this run's own state (the server's only)
                # In a session of its own: a terminal's Ctrl-C reaches the whole foreground process
                # group, and a server killed by it leaves the stopping flow nowhere to record its
                # state (it retried a dead server for minutes). It stops when the flow is done.
                return real_popen(*args, preexec_fn=die_with_parent, start_new_session=True, env=env, **kwargs)

            subprocess.Popen = popen
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = real_popen

    server = ServerDyingWithUs()
    try:
        # Prefect's default (20 s) is too short on 2 busy cores; 60 s holds
        server.start(timeout=max(60, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:  # send the last logs and events while the server still listens (else
                _drain_to_api()  # Prefect's exit-time drain retries a dead server for a minute)
    finally:
        server.stop()
        if "PREFECT_HOME" in extra_env:
            shutil.rmtree(extra_env["PREFECT_HOME"], ignore_errors=True)


def _own_state_dir() -> str:
    """A new folder for this run's server state, ``megatrain-prefect-run-<host>-<pid>-*`` in the
    temp dir; first the folders of runs on this host whose process is gone (killed: nothing
    removed them) are removed."""
    prefix = f"megatrain-prefect-run-{socket.gethostname()}-"
    for old in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


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
    (the ranks stopped, what was staged committed); otherwise the code of the failure's kind
    (``megatrain.cli.campaign_exit``: 4 for a stage's deterministic error, 1 for one that gave
    up), with the cause in one line and the command that resumes where it can get past it."""
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
    from megatrain.cli import campaign_exit

    failure = None if state.is_cancelled() else _failure(state)
    code, resumable = campaign_exit(failure, (STOP.reason or "cancelled") if state.is_cancelled() else None)
    if resumable:  # the campaign's id in the command: a campaign named on the command line resumes only by it
        import shlex

        from megatrain.launch.invocation import python_command

        # quoted as a shell reads it: a path with a space or an override with brackets stays one word
        resume = shlex.join([python_command(), "-m", "flows.pretrain", path, *overrides, *([] if any(
            o.startswith("id=") for o in overrides) else [f"id={campaign.id}"])])
        after = f"Resume: {resume}"
    else:  # the same command would fail the same way: no command to offer, what must change instead
        after = "Not resumable as it is: the same command fails the same way until what this line names changes"
    print(f"megatrain: campaign {campaign.id} {state.name.lower()}: {state.message.rstrip('.')}. {after}",
          file=sys.stderr)
    return code


def _failure(state) -> BaseException | None:
    """The error a Failed flow run holds (a stage's, passed up by the flow), or None."""
    try:
        found = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 (its result could not be read back: an unknown failure)
        return None
    return found if isinstance(found, BaseException) else None

