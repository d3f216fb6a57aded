"""A slow link named by the hosts' straggler view (reliability/slow_link.py): on two hosts x one rank,
tbf on node1's link at step 8 makes every step several times slower while forward stays as it was; the
view names node1's host, address and bridge link (not a rank: both ranks are equally slow), and with
reliability.evict_slow_host_after_s the host that stays slow is evicted through the lost-host path.
The rule itself, on made-up heartbeats: a compute slowdown or a recovered link is no slow link."""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace

from host_runs import jsonl, launch, overrides, shards

from megatrain.config import load_config
from megatrain.reliability.heartbeat_store import HeartbeatRecord
from megatrain.reliability.slow_link import SlowLinkView

# The run is long enough that only the eviction ends it (about 1.35 s a step once limited): the view's
# verdict comes when the slow steps have filled its window, which on a loaded machine was step 34.
RATE, FAULT_STEP, STEPS = "20mbit", 8, 120


def _view(evict_after_s=None, probe_times=None):
    cfg = load_config("configs/tiny-cpu.yaml", ["train.run_dir=/nonexistent/run"] +
                      ([f"reliability.evict_slow_host_after_s={evict_after_s}"] if evict_after_s else []))
    hosts = {f"node{i}": SimpleNamespace(address=f"10.0.0.{i + 1}", link=f"mtc000000v{i}") for i in range(2)}
    cluster = SimpleNamespace(host=lambda role: hosts[role])
    times = probe_times or {"10.0.0.1": 0.3, "10.0.0.2": 40.0}
    view = SlowLinkView(cfg, cluster, [0, 1], 1, lambda n: f"node{n}", probe=lambda address: times[address])
    view._report = lambda finding: setattr(view, "reported", finding)
    return view


def _beats(step_s: list[float], forward_s: list[float]) -> dict[int, HeartbeatRecord]:
    return {rank: HeartbeatRecord(rank=rank, step=len(step_s), host=f"node{rank}", recent_step_s=step_s,
                                  recent_forward_s=[[i, f] for i, f in enumerate(forward_s)]) for rank in range(2)}


def test_the_rule_names_the_link_only_when_steps_slow_and_forward_does_not():
    view = _view(evict_after_s=5)
    assert view(_beats([0.1] * 3, [0.02] * 3), now=0.0) is None  # steady
    assert view(_beats([0.1, 0.4, 0.4, 0.4], [0.02] * 4), now=1.0) is None  # slow: named, not evicted yet
    assert (view.reported["host"], view.reported["address"], view.reported["link"], view.reported["ranks"],
            view.reported["waiting"]) == ("node1", "10.0.0.2", "mtc000000v1", [1], [0])
    verdict = view(_beats([0.4] * 5, [0.02] * 5), now=6.5)
    assert verdict["cause"] == "slow_link" and verdict["node"] == 1 and "evicted" in verdict["message"]
    assert view(_beats([0.4] * 3 + [0.1] * 3, [0.02] * 6), now=7.0) is None and view.slow_since is None  # recovered
    compute = _view(evict_after_s=5)  # a rank computing slowly is the rank straggler's, not a link's
    compute(_beats([0.1] * 3, [0.02] * 3), now=0.0)
    assert compute(_beats([0.4] * 3, [0.1] * 3), now=9.0) is None and not hasattr(compute, "reported")
    even = _view(evict_after_s=1, probe_times={"10.0.0.1": 0.3, "10.0.0.2": 0.4})  # no link stands out
    even(_beats([0.1] * 3, [0.02] * 3), now=0.0)
    assert even(_beats([0.4] * 3, [0.02] * 3), now=9.0) is None and not hasattr(even, "reported")
    off = _view()  # evict_slow_host_after_s unset: named, never evicted
    off(_beats([0.1] * 3, [0.02] * 3), now=0.0)
    assert off(_beats([0.4] * 3, [0.02] * 3), now=1.0) is None and off(_beats([0.4] * 4, [0.02] * 4), now=999) is None
    assert off.reported["host"] == "node1"


def test_forward_jitter_of_a_busy_machine_does_not_reset_a_slow_links_clock():
    """4 hosts x 1 rank on 2 busy cores (load 15-22): steps 5.6x their steady time after tbf, forward
    medians 1.4-1.9x from the load. Forward's slowdown explains none of the step's: the link stays slow
    and is evicted; a machine that slows both alike (2x step, 2x forward) names nothing."""
    view = _view(evict_after_s=3)
    assert view(_beats([0.4] * 3, [0.068] * 3), now=0.0) is None
    assert view(_beats([0.4] * 3 + [2.2] * 3, [0.068] * 3 + [0.093] * 3), now=5.0) is None  # named: 5.5x, 1.37x
    assert view.reported["host"] == "node1" and view.slow_since == 5.0
    for now, forward in ((6.0, 0.105), (7.0, 0.114), (7.5, 0.128)):  # 1.54x, 1.68x, 1.88x: not compute
        verdict = view(_beats([0.4] * 3 + [2.2] * 3, [0.068] * 3 + [forward] * 3), now=now)
        assert verdict is None and view.slow_since == 5.0, (now, forward)
    verdict = view(_beats([0.4] * 3 + [2.2] * 3, [0.068] * 3 + [0.12] * 3), now=8.5)
    assert verdict["cause"] == "slow_link" and verdict["node"] == 1 and verdict["slow_for_s"] == 3.5
    busy = _view(evict_after_s=1)  # the whole machine twice as slow: compute, not a link
    busy(_beats([0.4] * 3, [0.068] * 3), now=0.0)
    assert busy(_beats([0.8] * 3, [0.136] * 3), now=9.0) is None and not hasattr(busy, "reported")


def test_a_tbf_limited_link_is_named_by_host_and_evicted(served_cluster2, shared_dir, shard_url):
    shards(shared_dir, shard_url)
    run_dir = shared_dir / "run"
    own_pids = set(served_cluster2.pids("node1"))  # the host's own (its init): what it holds when no rank runs
    fault = {"kind": "slow_link", "step": FAULT_STEP, "node": 1, "rate": RATE}
    code, out, wall = launch(served_cluster2, run_dir, "0,1", [*overrides(shared_dir, run_dir, STEPS, 100),
                             "reliability.evict_slow_host_after_s=3"], [fault])
    served_cluster2.clear_link("node1")
    assert code == 1, out[-4000:]
    node1 = served_cluster2.host("node1")
    named = json.loads((run_dir / "faults" / "slow-link.json").read_text())
    assert (named["host"], named["hostname"], named["address"], named["link"], named["ranks"], named["waiting"]) == \
        ("node1", "node1", node1.address, node1.link, [1], [0]), named
    assert f"slow link: host node1 ({node1.address}), link {node1.link}" in out
    verdict = json.loads((run_dir / "faults" / "host-lost.json").read_text())
    assert verdict["cause"] == "slow_link" and verdict["node"] == 1 and verdict["fault"] == "slow_link", verdict
    assert verdict["slow_for_s"] >= 3.0 and f"host node1 ({node1.address}) evicted" in out
    # evicted, not cut off: the launcher reaches it and stops its agent and ranks (a lost host's are left, fenced)
    # (nsenter ends on the signal at once; the pod inside stops its ranks, then goes: within 30 s)
    deadline = time.monotonic() + 30
    while (left := set(served_cluster2.pids("node1")) - own_pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:200] for p in left]
    rows = [r for r in jsonl(run_dir / "metrics.jsonl") if "step_time_s" in r]
    before = statistics.median(r["step_time_s"] for r in rows if 3 <= r["step"] < FAULT_STEP)
    after = statistics.median(r["step_time_s"] for r in rows if r["step"] > FAULT_STEP + 1)
    print(f"tbf {RATE}: step {before * 1000:.0f} ms -> {after * 1000:.0f} ms; {named['why']}; evicted after "
          f"{verdict['detection_s']:.1f} s from the fault, run {wall:.1f} s")
    assert after > 2 * before, (before, after)
