"""Fault-matrix rows for the campaign's lifecycle (issue 14), through the real ``pretrain`` flow:
stop requests (SIGTERM, SIGINT, a cancel), a second run of the same campaign, a killed flow
process, a deleted run dir and a deterministic error.

Each row asserts that the fault was detected, that nothing was lost (every committed checkpoint
verifies, and the final one equals a fault-free run's bit for bit), that the cause is named in
the Prefect state, and that the exit state is honest. Ranks are found in the process table
(``/proc``): a stop must leave none within 10 s on an idle machine, and within that plus two of
the run's own steps on a busy one (``stop_bound_s``).

Flow runs cost 30-60 s each on 2 loaded cores, so one campaign goes through several faults in
sequence where the faults do not interfere.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_matrix_common import (  # noqa: F401  (reproducible_cpu_math: autouse, pins MKL for bit-exactness)
    STEPS,
    assert_bit_exact,
    assert_committed_intact,
    logs,
    measured_step_s,
    reproducible_cpu_math,
    run_campaign,
    write_campaign,
)
from process_table import alive, processes_mentioning

from megatrain import storage
from megatrain.checkpoint import catalog
from megatrain.config.campaign import load_campaign

ROOT = Path(__file__).resolve().parents[2]
STOP_BOUND_S = 10.0  # ranks gone within this after a stop request, on an idle machine
# slow_rank in every attempt (once=false) stretches each step ~30x, with no change to the math,
# so that a stop lands mid-stage; fault-free and slowed runs commit identical checkpoints.
SLOWED = [{"kind": "slow_rank", "step": 1, "slowdown": 30, "once": False}]


# ---------------------------------------------------------------------------------------------
# helpers


def stop_bound_s(run_dir: Path) -> float:
    """How long a stop may take now: STOP_BOUND_S plus two of the run's own steps (slowed, as
    SLOWED makes them), measured just before the stop. On 2 cores shared with other jobs the flow
    notices the request, and its threads stop the ranks, as slowly as the ranks step: a fixed
    10 s failed at 11.9 s on a busy machine, where a stop that waits for the stage would still
    take minutes."""
    return STOP_BOUND_S + 2 * measured_step_s(run_dir)


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def children_of(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
    return found


def committed_steps(durable: str) -> list[int]:
    """The committed steps so far; none while the durable folder is not there yet (a poll can come
    before the first upload creates it: CI once failed on a StorageError 'not found' here)."""
    if not storage.exists(durable):
        return []
    return [info.step for info in catalog.committed(durable)]


class FlowProcess:
    """``python -m flows.pretrain <campaign>`` as an operator starts it, against the test server."""

    def __init__(self, path: Path, api_url: str | None, log: Path, args: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        env.pop("PREFECT_API_URL", None)
        if api_url:
            env["PREFECT_API_URL"] = api_url
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.pretrain", str(path), *(args or [])], cwd=ROOT,
                                     env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def flow_run_id(self) -> str:
        found = re.search(r"flow-run/([0-9a-f-]{36})", self.output)
        assert found, f"no flow run id in the output:\n{self.output[-2000:]}"
        return found.group(1)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the flow process did not exit within {timeout_s:.0f} s:\n{self.output[-3000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_states(flow_run_id: str) -> tuple[object, dict[str, list[object]]]:
    """The flow run's state and its task runs' states by task name (oldest first)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_state = client.read_flow_run(flow_run_id).state
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    by_name: dict[str, list[object]] = {}
    for run in sorted(task_runs, key=lambda r: r.expected_start_time or r.created):
        by_name.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state)
    return flow_state, by_name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lifecycle")


@pytest.fixture(scope="module")
def reference(prefect_api, workdir, shard_root) -> str:
    """A fault-free run of the one-stage, one-rank campaign; a copy of its committed checkpoints
    (the run itself is reused, then deleted, by the run-dir case)."""
    outcome = run_campaign(write_campaign(workdir, "reference", shard_url=shard_root))
    assert outcome.stage["attempts"] == 1
    copy = workdir / "reference-checkpoints"
    shutil.copytree(outcome.durable, copy)
    return str(copy)


# ---------------------------------------------------------------------------------------------
# the rows


def refuse_second_run(path: Path, owner: FlowProcess, metrics: Path) -> str:
    """A second run of the same campaign while ``owner`` runs it: refused at once, naming the
    owner, before any work (no shard, no stage task run) and without writing anything."""
    from flows.pretrain import pretrain

    rows_before = metrics.read_text()
    started = time.monotonic()
    second = pretrain(str(path), return_state=True)
    refused_s = time.monotonic() - started
    assert second.is_failed() and f"pid {owner.proc.pid}" in second.message, second.message
    assert "in use by flow run" in second.message and owner.flow_run_id() in second.message
    _, tasks = run_states(str(second.state_details.flow_run_id))
    assert "train-stage" not in tasks and "shard-data" not in tasks
    assert metrics.read_text().startswith(rows_before)  # not one row interleaved
    return f"second run refused in {refused_s:.1f} s: {second.message}"


@pytest.mark.slow
def test_stops_kills_and_a_concurrent_run_lose_nothing_and_reruns_end_bit_exact(
        prefect_api, reference, workdir, shard_root):
    """One slowed campaign, run again after each fault: a second run beside the first (refused),
    SIGTERM, SIGINT, a cancel from the CLI (each mid-stage, after a commit) and a SIGKILL of the
    flow process; the last rerun takes the killed run's lease over and finishes bit-exact."""
    from flows.pretrain import pretrain

    path = write_campaign(workdir, "stopped", shard_url=shard_root, faults=SLOWED)
    campaign = load_campaign(path)
    durable, marker = campaign.stage_durable_url(0), str(campaign.stage_dir(0) / "config.yaml")
    metrics = campaign.stage_dir(0) / "metrics.jsonl"
    for how, after_step, exit_code in (("SIGTERM", 2, 143), ("SIGINT", 4, 130), ("cancel", 6, 130)):
        flow = FlowProcess(path, prefect_api, workdir / f"stopped-{how}.log")
        try:
            wait_for(lambda: after_step in committed_steps(durable), 300, f"step {after_step} committed ({how} run)")
            assert processes_mentioning(marker), "no rank is training: nothing to stop"
            if how == "SIGTERM":
                print(refuse_second_run(path, flow, metrics))
            bound_s = stop_bound_s(campaign.stage_dir(0))
            requested = time.monotonic()
            if how == "cancel":  # the CLI's cancel, as the UI's button does
                subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", flow.flow_run_id()],
                               env=dict(os.environ, PREFECT_API_URL=prefect_api), check=True, capture_output=True)
            else:
                os.kill(flow.proc.pid, getattr(signal, how))
            stopped_s = wait_for(lambda: not processes_mentioning(marker), bound_s + 5, f"ranks gone after {how}")
            assert stopped_s <= bound_s, f"{how}: ranks still alive {stopped_s:.1f} s after the request (bound {bound_s:.1f} s)"
            assert flow.wait(60) == exit_code, flow.output[-3000:]
            exited_s = time.monotonic() - requested
        finally:
            flow.kill()
        steps = committed_steps(durable)
        assert after_step in steps and STEPS not in steps  # stopped mid-stage, nothing committed lost
        assert_committed_intact(durable, steps)  # every file of every committed step verifies
        flow_state, tasks = run_states(flow.flow_run_id())
        assert flow_state.is_cancelled(), (how, flow_state)
        (stage_state,) = tasks["train-stage"]
        assert stage_state.is_cancelled() and re.search(rf"stopped \(.*{'cancel' if how == 'cancel' else how}", stage_state.message), stage_state.message
        assert f"committed steps [" in stage_state.message and str(after_step) in stage_state.message
        assert tasks["launch-ranks"][-1].is_cancelled(), tasks["launch-ranks"][-1]
        assert tasks["upload-checkpoint"] and all(s.is_completed() and s.name == "Completed" for s in tasks["upload-checkpoint"]), \
            [s.name for s in tasks["upload-checkpoint"]]
        print(f"{how}: ranks gone {stopped_s:.1f} s after the request, flow process exited after {exited_s:.1f} s; "
              f"committed {steps}; flow {flow_state.name}: {stage_state.message}")

    # SIGKILL of the flow process, once its ranks run: no handler runs, the lease stays behind
    killed = FlowProcess(path, prefect_api, workdir / "stopped-SIGKILL.log")
    try:
        wait_for(lambda: processes_mentioning(marker), 300, "the ranks of the run to kill")
        bound_s = stop_bound_s(campaign.stage_dir(0))
        os.kill(killed.proc.pid, signal.SIGKILL)
        gone_s = wait_for(lambda: not processes_mentioning(marker), bound_s + 20, "ranks gone after SIGKILL")
        assert gone_s <= bound_s, (gone_s, bound_s)
        killed.wait(30)
    finally:
        killed.kill()
    assert (campaign.campaign_dir / "lease.json").exists()
    print(f"SIGKILL: ranks gone {gone_s:.1f} s after the flow process was killed")

    state = pretrain(str(path), return_state=True)  # takes the stale lease over, resumes from step 6
    assert state.is_completed(), state.message
    # the stage's attempts: the three stopped, the one killed with its flow (a log and no row:
    # nothing ended it) and this one
    assert state.result()["stages"][0]["attempts"] == 5
    killed_state, _ = run_states(killed.flow_run_id())
    assert killed_state.is_crashed() and f"({killed.proc.pid} on" in killed_state.message, killed_state
    assert not (campaign.campaign_dir / "lease.json").exists()  # released on exit
    assert_committed_intact(durable)
    assert_bit_exact(durable, reference)


@pytest.mark.slow
def test_a_deleted_run_dir_is_trained_again(
        prefect_api, reference, workdir, shard_root):
    from flows.pretrain import pretrain

    path = workdir / "reference.yaml"  # the reference campaign: its stage is in the cache
    campaign = load_campaign(path)
    shutil.rmtree(campaign.campaign_dir)
    state = pretrain(str(path), return_state=True)
    assert state.is_completed(), state.message
    report = state.result()
    assert report["stages"][0]["steps"] == STEPS  # the report found the retrained run's metrics
    _, tasks = run_states(str(state.state_details.flow_run_id))
    assert [s.name for s in tasks["train-stage"]] == ["Completed"]  # trained again, not "Cached"
    assert_committed_intact(campaign.stage_durable_url(0))
    assert_bit_exact(campaign.stage_durable_url(0), reference)


@pytest.mark.slow
def test_a_deterministic_error_in_a_rank_fails_the_stage_at_once_with_its_cause(prefect_api, workdir, shard_root):
    """Someone trains by hand in the stage's run dir (``megatrain train`` holds its lease): the
    stage's rank 0 refuses to write there, which no restart can fix."""
    from flows.pretrain import pretrain

    path = write_campaign(workdir, "run-dir-in-use", shard_url=shard_root)
    run_dir = load_campaign(path).stage_dir(0)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom megatrain.launch.lease import FileLeaseStore, Lease\n"
         "Lease(FileLeaseStore(sys.argv[1]), 'megatrain train by hand').acquire()\nprint('held', flush=True)\n"
         "time.sleep(600)\n", str(run_dir)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        state = pretrain(str(path), return_state=True)
    finally:
        holder.kill()
        holder.wait()
    assert state.is_failed(), state
    assert "LeaseHeld" in state.message and "megatrain train by hand" in state.message and f"pid {holder.pid}" in state.message
    _, tasks = run_states(str(state.state_details.flow_run_id))
    assert len(tasks["launch-ranks"]) == 1 and tasks["launch-ranks"][0].is_failed()  # no restart
    assert "attempt 1 deterministic" in tasks["launch-ranks"][0].message
    assert tasks["train-stage"][0].is_failed() and "LeaseHeld" in tasks["train-stage"][0].message
    assert not (run_dir / "metrics.jsonl").exists()  # the hand-run's dir was not written to
    print(f"deterministic error: {state.message}")


@pytest.mark.slow
def test_an_upload_that_fails_for_good_fails_the_stage_and_stops_its_ranks(prefect_api, workdir, shard_root, logs):
    """Durable storage stays down: each upload is retried with backoff, then the stage fails with
    the storage error as its state message (never "Completed" with nothing committed), and its
    ranks are stopped instead of training on alone."""
    from flows.pretrain import pretrain

    path = write_campaign(workdir, "storage-down", shard_url=shard_root,
                          overrides=["checkpoint.upload_retries=2", "checkpoint.upload_backoff_s=0.2"],
                          faults=[{"kind": "storage_outage", "step": 1, "duration_s": 3600}, *SLOWED])
    campaign = load_campaign(path)
    marker = str(campaign.stage_dir(0) / "config.yaml")
    state = pretrain(str(path), return_state=True)
    assert state.is_failed() and "durable storage unavailable" in state.message, state.message
    assert campaign.stage_durable_url(0) in state.message  # names the URL
    failed_at, _ = logs.need(r"Finished in state Failed\(.*durable storage unavailable")
    retries = [m for _, m in logs.records if "durable storage unavailable" in m and "Retry" in m]
    assert len(retries) >= 2, retries  # retried (twice) before it failed
    gone_s = wait_for(lambda: not processes_mentioning(marker), stop_bound_s(campaign.stage_dir(0)) + 20,
                      "ranks gone after the failure")
    assert catalog.committed(campaign.stage_durable_url(0)) == []  # nothing claimed, nothing committed
    _, tasks = run_states(str(state.state_details.flow_run_id))
    assert tasks["train-stage"][0].is_failed() and tasks["upload-checkpoint"][0].is_failed()
    assert tasks["launch-ranks"][0].is_cancelled() and "stopped (the stage failed)" in tasks["launch-ranks"][0].message
    print(f"storage down: stage failed after {len(retries)} retries: {state.message[:160]}; ranks gone {gone_s:.1f} s later")


def test_a_bad_campaign_is_a_few_lines_and_no_server_starts(workdir, shard_root, tmp_path):
    bad = write_campaign(tmp_path, "bad-source", shard_url=shard_root, overrides=['data.sources=["/no/such/*.txt"]'])
    flow = FlowProcess(bad, None, tmp_path / "bad-source.log")
    assert flow.wait(120) == 2
    lines = flow.output.strip().splitlines()
    assert len(lines) <= 3 and "data.sources" in flow.output and "/no/such/*.txt" in flow.output, lines
    assert "Traceback" not in flow.output and "temporary server" not in flow.output

    flow = FlowProcess(bad, None, tmp_path / "bad-field.log", args=["nproc_per_node=zero"])
    assert flow.wait(120) == 2
    assert len(flow.output.strip().splitlines()) <= 6 and "nproc_per_node" in flow.output, flow.output
    assert "Traceback" not in flow.output


@pytest.mark.slow
def test_the_temporary_server_of_a_command_line_run_dies_with_it_even_after_sigkill(tmp_path):
    script = ("import time\nfrom flows.lifecycle import temporary_server\nfrom prefect.settings import PREFECT_API_URL\n"
              "with temporary_server():\n    print('up', PREFECT_API_URL.value(), flush=True)\n    time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env.pop("PREFECT_API_URL", None)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line.startswith("up http://127.0.0.1:"), line
        servers = [pid for pid in children_of(parent.pid) if "uvicorn" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(servers) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        gone_s = wait_for(lambda: not alive(servers[0]), 15, "the temporary server to die with its parent")
        assert gone_s <= STOP_BOUND_S
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
