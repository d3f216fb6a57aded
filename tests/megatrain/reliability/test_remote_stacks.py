"""Stacks of a hung rank on another host (stacks.py's ``ask_stacks``, called by the watcher): the
watcher cannot signal a process there, so it asks through the heartbeat store (Redis) and the rank's heartbeat thread
answers with its own stacks while its main thread waits. The rank runs in a UTS namespace of its
own (hostname ``far-node``): its records name another host, as a rank inside a cluster host does.
Root and ``unshare`` are needed, as for every hosts test; without them the test fails."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from heartbeat_helpers import wait_for
from test_watcher import CHILD

from megatrain.reliability.heartbeat import DirectorySink, HeartbeatRecord, RedisSink
from megatrain.reliability.watcher import HeartbeatWatcher


def _on_another_host(argv: list[str], env: dict) -> subprocess.Popen:
    assert os.geteuid() == 0 and shutil.which("unshare"), "needs root and unshare (a UTS namespace per host)"
    script = 'hostname far-node && exec "$@"'
    return subprocess.Popen(["unshare", "--uts", "sh", "-c", script, "sh", *argv], env=env)


@pytest.mark.slow
def test_a_hung_rank_on_another_host_answers_with_its_stacks_through_the_store(tmp_path: Path, redis_url: str,
                                                                               run_id: str) -> None:
    sink = RedisSink(redis_url, run_id)
    watcher = HeartbeatWatcher(sink, world_size=2, timeout_s=1.0, init_timeout_s=30.0, stacks_dir=tmp_path / "here")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_RUN_TOKEN"}  # as this test's sink reads
    far = _on_another_host([sys.executable, "-c", CHILD, "redis", redis_url, run_id, "1", "hang",
                            str(tmp_path / "far")], env)
    near = subprocess.Popen([sys.executable, "-c", CHILD, "redis", redis_url, run_id, "0", "run",
                             str(tmp_path / "near")], env=env)
    try:
        wait_for(lambda: (r := sink.read_all(2)) and len(r) == 2 and r[1].phase == "collective", timeout_s=60)
        result = wait_for(lambda: (r := watcher.check()) and 1 in r.hung and r, timeout_s=30)
        assert result.records[1].host == "far-node" and result.records[0].host != "far-node"
        asked = time.monotonic()
        stacks = watcher.collect_stacks(result, [0, 1])
        assert "stuck_in_allreduce" in stacks[1], stacks  # its main thread, dumped by its heartbeat thread
        assert "heartbeat" in stacks[1] or "_answer_stack_request" in stacks[1], stacks  # the thread that answered
        assert "stuck_in_allreduce" not in stacks[0], stacks  # rank 0 on this host: its own, by signal
        print(f"\nstacks of the rank on far-node in {time.monotonic() - asked:.2f} s")
        # a frozen process answers nothing: its entry says so, within the request's timeout
        far.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        stopped = watcher.collect_stacks(result, [1])
        assert "no answer to the stack request" in stopped[1] and "far-node" in stopped[1], stopped
    finally:
        for proc in (far, near):
            proc.kill()
            proc.wait()
        watcher.close()


def test_the_hosts_watch_calls_only_beating_ranks_stuck_in_a_step_hung(tmp_path: Path) -> None:
    """HungOnlyWatch (a stage on hosts): a frozen step while every rank beats is a fault; a silent rank
    (its host lost: the host watch's verdict) or a step waiting in a save (a store's outage) is not."""
    from megatrain.reliability.host_watch import HungOnlyWatch

    def verdict(phases: dict[int, str], silent: int | None = None) -> list[int]:
        sink = DirectorySink(tmp_path / f"hb-{len(list(tmp_path.iterdir()))}")
        watch = HungOnlyWatch(HeartbeatWatcher(sink, world_size=len(phases), timeout_s=3.0, since=0), fresh_s=1.5)
        now = time.time()
        for rank, phase in phases.items():
            sink.publish(HeartbeatRecord(rank=rank, step=7, phase=phase, first_step_done=True, step_since=now - 10,
                                         phase_since=now - 10, timestamp=now - (20 if rank == silent else 0.1)))
        assert not watch.watcher.check().ok  # the plain watcher calls each of these a fault
        return watch.check().faulty

    assert verdict({0: "backward", 1: "forward"}) == [0, 1]
    assert verdict({0: "collective", 1: "forward"}, silent=1) == []  # rank 1's host went silent
    assert verdict({0: "checkpoint", 1: "checkpoint"}) == []  # a save that waits for the store
