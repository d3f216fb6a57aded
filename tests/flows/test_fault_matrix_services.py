"""The fault matrix (issue 6), faults outside the ranks, through the real campaign flow: one case
per fault. Durable storage down for a while, the newest committed checkpoint corrupted at rest
(then a crash, so a restart must restore), a data shard corrupted (skipped, or the campaign stops
naming it), Redis killed under the heartbeats. The campaign, checks and table are
``fault_matrix_common.py``'s; faults of a rank are in ``test_fault_matrix_ranks.py``. Run with
``-s`` to see the table.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time

import pytest

from fault_matrix_common import (  # noqa: F401  (fixtures are found by name; fault_table, reproducible_cpu_math: autouse)
    STEPS, assert_bit_exact, assert_committed_intact, durable_url, fault_table, fault_time, logs, record_row, reference,
    reproducible_cpu_math, run_campaign, workdir, write_campaign,
)
from megatrain.config.campaign import load_campaign, stage_config
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import step_dir_name
from megatrain.reliability.heartbeat import HeartbeatRecord


# ---------------------------------------------------------------------------------------------
# the cases: each on one rank


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
    from megatrain.launch.redis_client import connect

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
    client = connect(server["url"])  # with the server's password (MEGATRAIN_REDIS_PASSWORD)
    (key,) = client.keys(f"megatrain:{cfg.run_id}:heartbeat:*:0")  # the run's place (named by its token)
    (value,) = client.hgetall(key).values()  # one writer: the attempt's rank 0
    client.close()
    final = HeartbeatRecord.from_dict(json.loads(value))
    assert final.phase == "done" and final.step == STEPS and final.timestamp > restarted
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (1, 0)  # no false dead verdict
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(1))
    record_row("kill_redis", "watcher read + rank publish fail (no verdict)", t_fault, t_detect, t_recover, outcome,
               True, f"SIGKILL at step 2, back after {restarted - died:.1f} s; recovery = watcher reads again")
