"""The fault matrix (issue 6), faults of a rank, through the real campaign flow: one case per
fault. A rank killed, hung or slowed (rank 1 of 2), and a loss spike (one rank) that the anomaly
detector turns into a rollback. The campaign, checks and table are ``fault_matrix_common.py``'s;
faults outside the ranks (storage, checkpoints at rest, shards, Redis) are in
``test_fault_matrix_services.py``. Run with ``-s`` to see the table.

(No module here is called ``test_faults.py``: tests/ has no packages, so two test modules may
not share a basename, and tests/megatrain/reliability/test_faults.py exists.)
"""

from __future__ import annotations

import re

import pytest

from fault_matrix_common import (  # noqa: F401  (fixtures are found by name; fault_table, reproducible_cpu_math: autouse)
    INTERVAL_S, assert_bit_exact, assert_committed_intact, fault_table, fault_time, logs, measured_step_s, record_row,
    reference, reproducible_cpu_math, run_campaign, workdir, write_campaign,
)

STALL_LIMIT_MAX_S = 15.0  # the hang case's stall limit stays this far below the 60 s timeout
LOAD_SLACK_S = 2.0  # 2 CPU cores shared with other jobs: scheduling delays on top of a bound, plus
# two of the run's own measured steps (the watcher's process is as slow to look as the ranks to step)


# ---------------------------------------------------------------------------------------------
# the cases: kill, hang and slow act on rank 1 of 2; spike_loss on one rank


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
    # the default stall rule (20 x the median step, at least 5 s) under a 60 s heartbeat timeout
    outcome = run_campaign(write_campaign(workdir, "hang-rank", shard_url=shard_root, nproc=2,
                                          faults=[{"kind": "hang_rank", "step": 5, "rank": 1}]))
    t_fault = fault_time(outcome.run_dir, "hang_rank")
    t_detect, verdict = logs.need(r"\[watcher\] fault detected: .*hung=\[[^\]]*\b1\b", after=t_fault)
    # rank 1 is named, over the limit itself or hung with its waiting peer (whichever crossed first)
    logs.need(r"\[watcher\] rank 1: step 5 stuck [\d.]+ s in forward, (over|with a peer over) the stall limit",
              after=t_fault)
    _, note = logs.need(r"\[watcher\] rank \d: step 5 stuck [\d.]+ s in \w+, over the stall limit", after=t_fault)
    limit = float(re.search(r"stall limit ([\d.]+) s \(before the 60 s timeout\)", note).group(1))
    assert 5.0 <= limit < STALL_LIMIT_MAX_S, note  # steps of ~0.1 s: the 5 s floor, far below the timeout
    detection = t_detect - t_fault
    # the stall rule fired (not an earlier false verdict), within its limit + one interval (+ load)
    slack_s = LOAD_SLACK_S + 2 * measured_step_s(outcome.run_dir)
    assert limit - 1.0 < detection <= limit + INTERVAL_S + slack_s, (detection, slack_s)
    _, ended = logs.need(r"attempt 1 ended: hung", after=t_fault)
    rank1_stack = ended.split("--- stack of rank 1 ---", 1)[1].split("--- stack of rank", 1)[0]
    assert "hang_forever" in rank1_stack, ended  # the failure names where rank 1 is stuck
    t_recover, _ = logs.need(r"\bstep 5/8\b", after=t_detect)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(2))
    record_row("hang_rank", "heartbeat watcher (step frozen: stall rule), stacks", t_fault, t_detect, t_recover,
               outcome, True, f"rank 1 of 2 at step 5; stall limit {limit:.1f} s (timeout 60 s), "
               f"interval {INTERVAL_S:g} s")


@pytest.mark.slow
def test_freeze_rank(reference, workdir, shard_root, logs):
    """SIGSTOP of rank 1 (a debugger, a stalled machine): the whole process stops, its heartbeat
    thread too. The verdict names rank 1 alone (frozen) and rank 0 as waiting for it; rank 0's
    stack is collected, rank 1's entry says it cannot answer; the stage recovers bit-exact."""
    outcome = run_campaign(write_campaign(workdir, "freeze-rank", shard_url=shard_root, nproc=2,
                                          faults=[{"kind": "freeze_rank", "step": 5, "rank": 1}]))
    t_fault = fault_time(outcome.run_dir, "freeze_rank")
    t_detect, verdict = logs.need(r"\[watcher\] fault detected: frozen=\[1\] .*waiting=\[0\]", after=t_fault)
    assert "hung=" not in verdict, verdict  # the waiting rank is not blamed
    _, ended = logs.need(r"attempt 1 ended: hung", after=t_fault)
    assert "--- stack of rank 0 ---" in ended, ended  # the rank that can answer gives its stack
    rank1 = ended.split("--- stack of rank 1 ---", 1)[1].split("--- stack of rank", 1)[0]
    assert "frozen" in rank1 and "state T: stopped by a signal" in rank1, rank1
    t_recover, _ = logs.need(r"\bstep 5/8\b", after=t_detect)
    assert (outcome.stage["attempts"], outcome.stage["restarts"]) == (2, 1)
    assert_committed_intact(outcome.durable)
    assert_bit_exact(outcome.durable, reference(2))
    record_row("freeze_rank", "heartbeat watcher (silent with its step: frozen)", t_fault, t_detect, t_recover,
               outcome, True, "SIGSTOP rank 1 of 2 at step 5; rank 0 reported waiting, not hung")


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
