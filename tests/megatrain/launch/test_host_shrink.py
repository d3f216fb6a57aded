"""Shrink on the survivors after a lost host (reliability.on_node_loss: shrink on the hosts launcher):
two hosts x one rank, host_down of node1 at step 26; the heartbeat watch names node1, the next attempt (a
new fencing epoch) runs on node0 alone (dp 2 -> 1, accumulation 1 -> 2, the same global batch) from the
newest committed checkpoint (read from the storage host's S3), and the run finishes. Its losses after
the shrink are those of a fault-free run of the final layout (one host, one rank) resumed from a copy of
that checkpoint, bit for bit. The detection time (fault injected -> verdict) is in the verdict and
printed."""

from __future__ import annotations

import json

from host_runs import copy_step, jsonl, launch, losses, manifests, overrides, shards, step_url, use_s3

# The commits to S3 run ~1.5 s behind the 0.12 s steps of this tiny model (the first upload of each rank
# opens its S3 client; a commit polls every 0.5 s for the other rank's marker): the fault comes late
# enough that one is committed when it does
STEPS, INTERVAL, FAULT_STEP = 32, 2, 26


def test_host_down_shrinks_to_the_survivor_and_matches_a_resumed_run(served_cluster2, shared_dir, shard_url,
                                                                      monkeypatch):
    use_s3(served_cluster2, monkeypatch)  # the checkpoints live on the storage host's S3
    shards(shared_dir, shard_url)
    run_dir = shared_dir / "shrink"
    args = [*overrides(shared_dir, run_dir, STEPS, INTERVAL), "reliability.on_node_loss=shrink"]
    fault = {"kind": "host_down", "step": FAULT_STEP, "node": 1}
    code, out, wall = launch(served_cluster2, run_dir, "0,1", args, [fault])
    assert code == 0, out[-5000:]
    assert "shrink: attempt 2 on nodes [0] without node 1 (node1): 1 ranks, dp 1, accumulation 2" in out, out[-4000:]
    verdict = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    print(f"host_down detection: {verdict['detection_s']:.2f} s after the fault (heartbeat timeout "
          f"{verdict['heartbeat_timeout_s']} s, silent {verdict['silent_s']} s); whole run {wall:.1f} s")
    assert (verdict["node"], verdict["fault"]) == (1, "host_down")
    # the fault is stamped just after the link goes down, the silence counted from the last beat before it
    assert verdict["heartbeat_timeout_s"] - 0.5 <= verdict["detection_s"] < verdict["heartbeat_timeout_s"] + 4
    epochs = jsonl(run_dir / "epochs.jsonl")
    assert [e["nodes"] for e in epochs] == [[0, 1], [0]] and epochs[1]["epoch"] == epochs[0]["epoch"] + 1
    attempts = jsonl(run_dir / "host-attempts.jsonl")
    assert [(a["nodes"], a["exit"]) for a in attempts] == [([0, 1], 1), ([0], 0)]
    restores = jsonl(run_dir / "restores.jsonl")
    assert len(restores) == 1 and restores[0]["world_size"] == 1, restores
    resumed = restores[0]["step"]
    assert resumed >= INTERVAL and resumed % INTERVAL == 0, resumed
    # every commit's manifest names its attempt: up to the resume step the first epoch's, after it the second's
    committed = manifests(run_dir)
    assert resumed in committed and max(committed) == STEPS, sorted(committed)
    for manifest in committed.values():
        expected = epochs[0]["epoch"] if manifest["step"] <= resumed else epochs[1]["epoch"]
        assert manifest["epoch"] == expected and manifest["layout"]["world_size"] == (2 if expected == epochs[0]["epoch"]
                                                                                        else 1)
    shrunk = losses(run_dir)
    assert sorted(shrunk) == list(range(1, STEPS + 1))

    # the reference: one host, one rank, no fault, resumed from a copy of the same checkpoint
    ref_dir = shared_dir / "reference"
    copy_step(step_url(run_dir, resumed), step_url(ref_dir, resumed))
    code, out, _ = launch(served_cluster2, ref_dir, "0", [*overrides(shared_dir, ref_dir, STEPS, INTERVAL),
                                                          "parallel.world_size=1"], module="megatrain.launch.nodes")
    assert code == 0, out[-4000:]
    reference = losses(ref_dir)
    assert sorted(reference) == list(range(resumed + 1, STEPS + 1))
    print(f"shrunk run resumed from step {resumed} on 1 rank; steps {resumed + 1}-{STEPS} equal the reference's")
    assert {s: shrunk[s] for s in reference} == reference  # bit for bit
