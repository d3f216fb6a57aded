"""The fault matrix (issue 6), proved through the real campaign flow: one case per fault.

Every case runs the ``pretrain`` flow against a real Prefect server with real ranks (torchrun,
gloo, the real data pipeline), injects one fault, and checks that it is detected, that the
campaign recovers without a person, that no committed checkpoint is lost, and - where the fault
does not change the math - that every committed checkpoint equals a fault-free run's bit for bit.

Times come from the fault's marker file (``<run_dir>/faults/fired-<kind>-*.json``, written just
before it fires) and from the flow's log records (the ranks' output is streamed into it):
detection = the first record that shows the fault was seen; recovery = the first record that
shows the campaign past it (usually: the next attempt finished the fault's step). Run with
``-s`` to see the table.

(The file is not called ``test_faults.py``: tests/ has no packages, so two test modules may not
share a basename, and tests/megatrain/reliability/test_faults.py exists.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatrain.campaign import load_campaign, stage_config
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import load_safetensors, step_dir_name
from megatrain.checkpoint.restore import verify_checkpoint
from megatrain.reliability.heartbeat import HeartbeatRecord

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
COMMITTED = [4, 6, 8]  # checkpoint.interval=2 and the default keep_last=3
INTERVAL_S = 0.5  # heartbeat interval in every case
HANG_TIMEOUT_S = 4.0  # heartbeat timeout of the hang case (the others keep 60 s)
LOAD_SLACK_S = 2.0  # 2 CPU cores shared with other jobs: scheduling delays on top of a bound
TABLE: list[dict] = []


# ---------------------------------------------------------------------------------------------
# helpers


def write_campaign(directory: Path, campaign_id: str, *, shard_url: Path, nproc: int = 1,
                   overrides: list[str] | None = None, faults: list[dict] | None = None) -> Path:
    """One stage of STEPS steps of the tiny recipe at one layer; every path under ``directory``."""
    base = ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2",
            "train.log_interval=1", f"reliability.heartbeat_interval_s={INTERVAL_S}",
            "reliability.heartbeat_timeout_s=60"]
    if nproc == 2:
        base.append("train.micro_batch_size=4")  # global batch 8 over 2 data-parallel ranks
    stage = list(overrides or [])
    if faults:
        stage.append("reliability.faults=" + json.dumps(faults))
    doc = {
        "id": campaign_id, "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": nproc,
        "root_dir": str(directory / "campaigns"), "shard_url": str(shard_url), "self_check": False,
        "overrides": base, "stages": [{"name": "only", "steps": STEPS, "overrides": stage}],
    }
    path = directory / f"{campaign_id}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class LogCapture(logging.Handler):
    """Every log record of this process (the flow runs in it; rank output arrives as task-run
    records), with its time."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.created, record.getMessage()))
        except Exception:  # a record that cannot format is not ours to fail on
            pass

    def find(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        regex = re.compile(pattern)
        return next(((t, m) for t, m in list(self.records) if t >= after and regex.search(m)), None)

    def need(self, pattern: str, after: float = 0.0) -> tuple[float, str]:
        found = self.find(pattern, after)
        assert found is not None, (f"no log record matching {pattern!r} after {after:.3f} among "
                                   f"{len(self.records)}; last: {[m[:120] for _, m in self.records[-3:]]}")
        return found


@pytest.fixture
def logs():
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's first setup replaces the root handlers: ours must come after
    handler = LogCapture()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@dataclass
class Outcome:
    path: Path
    report: dict
    run_dir: Path
    durable: str

    @property
    def stage(self) -> dict:
        return self.report["stages"][0]


def run_campaign(path: Path) -> Outcome:
    from flows.pretrain import pretrain

    campaign = load_campaign(path)
    report = pretrain(str(path))
    return Outcome(path, report, Path(stage_config(campaign, 0).train.run_dir), campaign.stage_durable_url(0))


def durable_url(directory: Path, campaign_id: str) -> str:
    """A campaign's stage durable URL, known before the campaign file exists (fault targets)."""
    return str(directory / "campaigns" / campaign_id / "durable" / "only")


def fault_time(run_dir: Path, kind: str) -> float:
    markers = list((run_dir / "faults").glob(f"fired-{kind}-*.json"))
    assert markers, f"the {kind} fault never fired (no marker in {run_dir / 'faults'})"
    return min(m.stat().st_mtime for m in markers)


def checkpoint_tensors(durable: str, step: int) -> dict[str, object]:
    step_dir = Path(durable) / step_dir_name(step)
    tensors = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        for name, tensor in load_safetensors(path.read_bytes()).items():
            tensors[f"{path.name}:{name}"] = tensor
    assert tensors, f"{step_dir}: no tensors"
    return tensors


def assert_committed_intact(durable: str, expected: list[int] = COMMITTED) -> None:
    """Exactly the checkpoints retention keeps are committed, and every file of each verifies."""
    infos = catalog.committed(durable)
    assert [info.step for info in infos] == expected
    for info in infos:
        assert verify_checkpoint(info.url, info.manifest) == [], info.url


def assert_bit_exact(durable: str, reference: str, steps: list[int] = COMMITTED) -> None:
    """Weights, optimizer state and RNG of every committed step equal the reference's."""
    for step in steps:
        want, got = checkpoint_tensors(reference, step), checkpoint_tensors(durable, step)
        assert want.keys() == got.keys(), step
        for key in want:
            assert want[key].dtype == got[key].dtype and bool((want[key] == got[key]).all()), (step, key)


def record_row(fault: str, detected_by: str, t_fault: float, t_detect: float, t_recover: float | None,
               outcome: Outcome, bit_exact: bool | None, note: str = "") -> None:
    stage = outcome.stage
    TABLE.append({
        "fault": fault, "detected by": detected_by, "detection_s": round(t_detect - t_fault, 2),
        "recovery_s": None if t_recover is None else round(t_recover - t_fault, 2),
        "attempts": stage["attempts"], "restarts": stage["restarts"], "rollbacks": stage["rollbacks"],
        "bit_exact": bit_exact, "note": note,
    })


def format_table(rows: list[dict]) -> str:
    head = f"| {'fault':<18} | {'detected by':<45} | {'detect s':>8} | {'recover s':>9} | att | rst | rb | bit-exact | note"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        exact = {True: "yes", False: "no", None: "n/a (math changes)"}[r["bit_exact"]]
        recover = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        lines.append(f"| {r['fault']:<18} | {r['detected by']:<45} | {r['detection_s']:>8.2f} | {recover:>9} | "
                     f"{r['attempts']:>3} | {r['restarts']:>3} | {r['rollbacks']:>2} | {exact} | {r['note']}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def fault_table(tmp_path_factory):
    """Prints the detection/recovery table after the module (``pytest -s``) and saves it as JSON
    (to ``$MEGATRAIN_FAULT_TABLE`` when set: benchmarks/chaos.py --campaign reads it there)."""
    yield TABLE
    if TABLE:
        out = Path(os.environ.get("MEGATRAIN_FAULT_TABLE") or tmp_path_factory.mktemp("fault-table") / "fault_table.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(TABLE, indent=2))
        print(f"\n\nfault matrix (times from the fault's marker file; {out})\n{format_table(TABLE)}\n")


@pytest.fixture(scope="module", autouse=True)
def reproducible_cpu_math():
    """Pin MKL to one code path (its conditional numerical reproducibility mode) for every rank
    this module starts: with MKL choosing at run time, two runs on this VM once differed in the
    last bits of the first backward (1e-7), which a bit-for-bit comparison rightly catches."""
    before = os.environ.get("MKL_CBWR")
    os.environ["MKL_CBWR"] = before or "AVX2"
    yield
    if before is None:
        os.environ.pop("MKL_CBWR", None)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-matrix")


@pytest.fixture(scope="module")
def reference(prefect_api, workdir, shard_root):
    """``reference(nproc)``: the durable URL of a fault-free run of the same campaign on ``nproc``
    ranks (run once per module, on first use)."""
    runs: dict[int, str] = {}

    def get(nproc: int) -> str:
        if nproc not in runs:
            outcome = run_campaign(write_campaign(workdir, f"reference-{nproc}rank", shard_url=shard_root, nproc=nproc))
            assert outcome.stage["attempts"] == 1
            assert_committed_intact(outcome.durable)
            runs[nproc] = outcome.durable
        return runs[nproc]

    return get


# ---------------------------------------------------------------------------------------------
# the cases: kill, hang and slow act on rank 1 of 2; the others on one rank


@pytest.mark.slow
def test_kill_rank(reference, workdir, shard_root, logs):
    outcome = run_campaign(write_campaign(workdir, "kill-rank", shard_url=shard_root, nproc=2,
                                          faults=[{"kind": "kill_rank", "step": 5, "rank": 1}]))
    t_fault = fault_time(outcome.run_dir, "kill_rank")
    t_detect, ended = logs.need(r"attempt 1 ended: crashed", after=t_fault)
    # the cause is torchrun's root cause (rank 1's SIGKILL, in step 5), not rank 0's gloo error after it
    assert ended.endswith("rank 1 was killed by SIGKILL (exit code -9) in step 5"), ended
    # and the attempt is a failed (red) launch-ranks task run with that cause, while the stage recovered
    logs.need(r"Finished in state Failed\('attempt 1 crashed: rank 1 was killed by SIGKILL", after=t_fault)
    t_recover, _ = logs.need(r"\bstep 5/8\b", after=t_detect)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(2))
    record_row("kill_rank", "torchrun worker exit -> launch task", t_fault, t_detect, t_recover, outcome, True,
               "SIGKILL rank 1 of 2 at step 5")


@pytest.mark.slow
def test_hang_rank(reference, workdir, shard_root, logs):
    outcome = run_campaign(write_campaign(
        workdir, "hang-rank", shard_url=shard_root, nproc=2,
        overrides=[f"reliability.heartbeat_timeout_s={HANG_TIMEOUT_S}"],
        faults=[{"kind": "hang_rank", "step": 5, "rank": 1}]))
    t_fault = fault_time(outcome.run_dir, "hang_rank")
    t_detect, verdict = logs.need(r"\[watcher\] fault detected: .*hung=\[[^\]]*\b1\b", after=t_fault)
    detection = t_detect - t_fault
    # the timeout rule fired (not an earlier false verdict), within timeout + one interval (+ load)
    assert HANG_TIMEOUT_S - 1.0 < detection <= HANG_TIMEOUT_S + INTERVAL_S + LOAD_SLACK_S, detection
    _, ended = logs.need(r"attempt 1 ended: hung", after=t_fault)
    rank1_stack = ended.split("--- stack of rank 1 ---", 1)[1].split("--- stack of rank", 1)[0]
    assert "hang_forever" in rank1_stack, ended  # the failure names where rank 1 is stuck
    t_recover, _ = logs.need(r"\bstep 5/8\b", after=t_detect)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(2))
    record_row("hang_rank", "heartbeat watcher (step frozen), stacks", t_fault, t_detect, t_recover, outcome, True,
               f"rank 1 of 2 at step 5; timeout {HANG_TIMEOUT_S:g} s, interval {INTERVAL_S:g} s")


@pytest.mark.slow
def test_slow_rank(reference, workdir, shard_root, logs):
    outcome = run_campaign(write_campaign(workdir, "slow-rank", shard_url=shard_root, nproc=2,
                                          faults=[{"kind": "slow_rank", "step": 1, "rank": 1, "slowdown": 1.0}]))
    t_fault = fault_time(outcome.run_dir, "slow_rank")
    t_detect, note = logs.need(r"\[watcher\] rank 1 is slow", after=t_fault)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (1, 0)  # reported, nothing stopped
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(2))
    factor = re.search(r"forward ([\d.]+)x", note).group(1)
    record_row("slow_rank", "heartbeat watcher (forward time vs peers)", t_fault, t_detect, None, outcome, True,
               f"rank 1 +100% step time from step 1; seen as forward {factor}x peers")


@pytest.mark.slow
def test_spike_loss(workdir, shard_root, logs, prefect_api):
    from megatrain.reliability.rollback import read_rollbacks

    outcome = run_campaign(write_campaign(
        workdir, "spike-loss", shard_url=shard_root,
        # spike verdicts from step 3 on; a 10x loss is thousands of robust sigmas, noise is < 30
        overrides=["reliability.anomaly.warmup_steps=3", "reliability.anomaly.min_history=3",
                   "reliability.anomaly.loss_spike_zscore=30"],
        faults=[{"kind": "spike_loss", "step": 6, "rank": 0, "magnitude": 10}]))
    t_fault = fault_time(outcome.run_dir, "spike_loss")
    t_detect, _ = logs.need(r"anomaly at step 6: .*loss", after=t_fault)
    t_recover, _ = logs.need(r"\bstep 6/8\b", after=t_detect)
    assert (outcome.stage["attempts"], outcome.stage["rollbacks"], outcome.stage["restarts"]) == (2, 1, 0)
    (rollback,) = read_rollbacks(outcome.run_dir)
    assert (rollback.kind, rollback.anomaly_step, rollback.restore_step, rollback.skip_samples) == ("loss_spike", 6, 4, 16)
    assert_committed_intact(outcome.durable)
    record_row("spike_loss", "anomaly detector -> verdict -> rollback", t_fault, t_detect, t_recover, outcome, None,
               "loss x10 at step 6; back to step 4, 2 batches skipped (NaN: tests/flows/test_pretrain.py)")


@pytest.mark.slow
def test_storage_outage(reference, workdir, shard_root, logs):
    outage_s = 5.0
    outcome = run_campaign(write_campaign(workdir, "storage-outage", shard_url=shard_root,
                                          faults=[{"kind": "storage_outage", "step": 1, "duration_s": outage_s}]))
    t_fault = fault_time(outcome.run_dir, "storage_outage")
    t_detect, failure = logs.need(r"durable storage unavailable", after=t_fault)
    assert outcome.durable in failure  # the error names the URL
    t_recover, _ = logs.need(r"committed step 2 to ", after=t_fault)
    t_staged, _ = logs.need(r"staged step 4 \(rank 0\)", after=t_fault)
    assert t_recover >= t_fault + outage_s - 0.5  # nothing was committed while storage was down
    assert t_staged < t_recover  # training kept stepping (and staging) through the outage
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (1, 0)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(1))
    record_row("storage_outage", "upload task fails, Prefect retries", t_fault, t_detect, t_recover, outcome, True,
               f"{outage_s:g} s from step 1; recovery = step 2 committed")


@pytest.mark.slow
def test_corrupt_checkpoint(reference, workdir, shard_root, logs):
    target = f"{durable_url(workdir, 'corrupt-checkpoint')}/{step_dir_name(6)}"
    # corrupt the newest committed checkpoint (step 6) at rest, then crash, so a restart must restore
    outcome = run_campaign(write_campaign(workdir, "corrupt-checkpoint", shard_url=shard_root, faults=[
        {"kind": "corrupt_checkpoint", "step": 7, "target": target}, {"kind": "kill_rank", "step": 7}]))
    t_fault = fault_time(outcome.run_dir, "corrupt_checkpoint")
    t_detect, why = logs.need(rf"{step_dir_name(6)} rejected, falling back", after=t_fault)
    assert "sha256" in why or "size" in why  # it says why: the checksum
    logs.need(rf"restored checkpoint \S*{step_dir_name(4)} \(step 4\)", after=t_detect)
    t_recover, _ = logs.need(r"\bstep 7/8\b", after=t_detect)
    logs.need(r"committed step 6 does not verify .*replacing it", after=t_detect)  # the redone step 6 replaced it
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(1))
    record_row("corrupt_checkpoint", "restore: sha256 mismatch -> older step", t_fault, t_detect, t_recover, outcome,
               True, "step 6 corrupted at rest, kill at 7; restored 4, step 6 re-committed")


@pytest.mark.slow
def test_corrupt_shard(workdir, tmp_path, logs, prefect_api):
    from megatrain.data.loader import SampleOrder
    from megatrain.data.shard import shard_corpus

    shards = tmp_path / "shards"  # private: the session's shard_root is shared with other tests
    layout = ["data.samples_per_shard=8", "data.shuffle_shards=2"]  # a shuffle window = 16 samples = 2 steps
    probe = load_campaign(write_campaign(tmp_path, "probe", shard_url=shards, overrides=layout))
    cfg = stage_config(probe, 0)
    index = shard_corpus(cfg.data, cfg.seq_len, cfg.model.vocab_size)
    order = SampleOrder([s.num_samples for s in index.shards], cfg.data.seed, cfg.data.shuffle_shards)
    earlier = {int(s) for s in order.take(0, 0, 6 * 8)[0][:, 0]}
    later = [int(s) for s in order.take(0, 6 * 8, 8 * 8)[0][:, 0] if int(s) not in earlier]
    target = index.shard_url(later[0])  # first read for step 7: far behind the prefetcher at step 1

    outcome = run_campaign(write_campaign(workdir, "corrupt-shard", shard_url=shards,
                                          overrides=[*layout, "data.on_bad_shard=skip"],
                                          faults=[{"kind": "corrupt_shard", "step": 1, "target": target}]))
    t_fault = fault_time(outcome.run_dir, "corrupt_shard")
    t_detect, _ = logs.need(rf"skipping bad shard {re.escape(target)}: sha256", after=t_fault)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (1, 0)
    assert_committed_intact(outcome.durable)
    manifest = catalog.committed(outcome.durable)[-1].manifest
    assert manifest["data_position"]["0"]["bad_shards"] == 1  # counted, and carried in the checkpoint
    record_row("corrupt_shard", "loader: sha256 vs index -> skip", t_fault, t_detect, None, outcome, None,
               "on_bad_shard=skip: substituted, counted, logged")

    # The same (still corrupt) shard with on_bad_shard=error: the campaign stops and names the shard.
    from flows.pretrain import pretrain

    failing = write_campaign(workdir, "corrupt-shard-error", shard_url=shards,
                             overrides=[*layout, "data.on_bad_shard=error", "reliability.max_restarts=0"])
    with pytest.raises(Exception, match=re.escape(target)) as failed:
        pretrain(str(failing))
    assert "BadShardError" in str(failed.value) and "sha256" in str(failed.value)


@pytest.fixture
def restarting_redis(tmp_path):
    """A redis-server that comes back ``delay_s`` after it dies, on the same port (as Kubernetes
    restarts a crashed pod), with a pid file for the kill_redis fault."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    from megatrain.reliability.redis_server import start_redis_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url, pidfile, delay_s = f"redis://127.0.0.1:{port}/0", tmp_path / "redis.pid", 1.5
    state = {"proc": None, "stop": False, "restarts": []}

    def start() -> None:
        proc = start_redis_server(port)
        state["proc"] = proc
        pidfile.write_text(f"{proc.pid}\n")

    def supervise() -> None:
        while not state["stop"]:
            proc = state["proc"]
            if proc.poll() is None:
                time.sleep(0.05)
                continue
            died = time.time()
            time.sleep(delay_s)
            if not state["stop"]:
                start()
                state["restarts"].append((died, time.time()))

    start()
    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    yield {"url": url, "pidfile": pidfile, "restarts": state["restarts"], "delay_s": delay_s}
    state["stop"] = True
    supervisor.join(timeout=delay_s + 15)
    state["proc"].terminate()
    state["proc"].wait(timeout=10)


@pytest.mark.slow
def test_kill_redis(reference, workdir, shard_root, logs, restarting_redis):
    import redis

    server = restarting_redis
    path = write_campaign(
        workdir, "kill-redis", shard_url=shard_root, overrides=[f"reliability.redis_url={server['url']}"],
        # slow_rank only stretches the run (x6 step time, no math change) so that it is still
        # training when Redis comes back, and the heartbeats can be seen to resume
        faults=[{"kind": "kill_redis", "step": 2, "target": str(server["pidfile"])},
                {"kind": "slow_rank", "step": 1, "slowdown": 5}])
    outcome = run_campaign(path)
    t_fault = fault_time(outcome.run_dir, "kill_redis")
    assert len(server["restarts"]) == 1
    died, restarted = server["restarts"][0]
    seen = [found for found in (logs.find(r"\[watcher\] heartbeat store unreadable", after=t_fault),
                                logs.find(r"heartbeat publish failed", after=t_fault)) if found]
    assert seen, "nobody noticed that Redis was gone"
    t_detect = min(t for t, _ in seen)
    t_recover, _ = logs.need(r"\[watcher\] heartbeat store readable again", after=t_fault)
    logs.need(r"heartbeat publish recovered", after=t_fault)  # the rank's writer got through again
    assert t_recover >= restarted - 0.1
    # the restarted server started empty: the rank's final record there was published after it came back
    cfg = stage_config(load_campaign(path), 0)
    client = redis.Redis.from_url(server["url"])
    raw = client.hgetall(f"megatrain:{cfg.run_id}:heartbeat:0")
    client.close()
    final = HeartbeatRecord.from_dict({k.decode(): json.loads(v) for k, v in raw.items()})
    assert final.phase == "done" and final.step == STEPS and final.timestamp > restarted
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (1, 0)  # no false dead verdict
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(1))
    record_row("kill_redis", "watcher read + rank publish fail (no verdict)", t_fault, t_detect, t_recover, outcome,
               True, f"SIGKILL at step 2, back after {restarted - died:.1f} s; recovery = watcher reads again")
