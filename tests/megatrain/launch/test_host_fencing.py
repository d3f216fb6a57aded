"""Fencing with the attempt epoch (launch/fencing.py), two hosts x one rank, on_node_loss: shrink:
node1 (not rank 0's host) partitioned at step 5 for 7 s is named lost like host_down, attempt 2 (epoch
+ 1) runs on node0; its ranks are out of reach and live on, and once the link is back the store refuses
their heartbeats, and a stale writer in node1 (the real heartbeat and upload paths, the old epoch) is
refused its heartbeat and its upload and commit. No commit of the old epoch after the fence, exactly one
epoch per committed step (the run's commit log in Redis and every manifest); detection time printed."""

from fencing_case import fenced_run


def test_a_partitioned_node_is_fenced_out(served_cluster2, shared_dir, shard_url, monkeypatch):
    fenced_run(served_cluster2, shared_dir, shard_url, 1, monkeypatch)
