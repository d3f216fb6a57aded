"""No split brain when rank 0's host is cut off (launch/fencing.py), two hosts x one rank,
on_node_loss: shrink: node0 (rank 0, the committer) partitioned at step 5 for 7 s; node1's watch names
it lost, attempt 2 (epoch + 1) runs on node1 alone as rank 0 and takes over the run dir's lease from
the fenced holder. The stale rank 0 lives on; when its link is back its uploads, commits and heartbeats
are refused, and exactly one attempt commits any given step (the commit log in Redis and every
manifest). Detection time printed."""

from fencing_case import fenced_run


def test_the_committers_host_cut_off_commits_nothing_twice(served_cluster2, shared_dir, shard_url, monkeypatch):
    log = fenced_run(served_cluster2, shared_dir, shard_url, 0, monkeypatch)
    print(f"commits refused to the stale rank 0 itself: {log['fenced'].get('commit', 0)}")
