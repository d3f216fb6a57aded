"""A cluster node's ranks (megatrain.launch.pod): no torchrun agent, so no unauthenticated store
listens; they meet in the password-protected Redis (issue 48)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "flows"))
from listening_sockets import ListeningSockets  # noqa: E402

from megatrain.launch.pod import pod_rank_env  # noqa: E402
from megatrain.launch.ranks import free_port  # noqa: E402

WORKER = Path(__file__).with_name("pod_worker.py")


def test_each_rank_of_a_node_gets_its_global_place():
    env = pod_rank_env(node=2, nnodes=3, nproc=4, local=1, master_addr="job-0.job", master_port=29500)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("9", "1", "12", "4", "2")


@pytest.mark.slow
def test_two_nodes_meet_in_redis_and_nothing_listens_at_the_rendezvous_address(redis_url):
    port, run_id = free_port(), f"pods-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "POD_TEST_REDIS_URL": redis_url}
    with ListeningSockets(interval_s=0.1) as sampled:
        pods = [subprocess.Popen([sys.executable, "-m", "megatrain.launch.pod", "--nnodes", "2", "--nproc-per-node", "1",
                                  "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  "--script", str(WORKER), run_id], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        outputs = [pod.communicate(timeout=120)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    assert "[rank0]: rank 0 of 2: sum 2" in outputs[0] and "[rank1]: rank 1 of 2: sum 2" in outputs[1], outputs
    ours = [found for found in sampled.seen if "megatrain.launch.pod" in found.command or str(WORKER) in found.command]
    assert not [found for found in ours if found.port == port], "a store listened at the rendezvous address"
    assert not sampled.exposed(), sampled.exposed()


@pytest.mark.slow
def test_the_first_rank_to_fail_stops_the_node_with_its_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['LOCAL_RANK'] == '1':\n    sys.exit(4)\ntime.sleep(60)\n")
    done = subprocess.run([sys.executable, "-m", "megatrain.launch.pod", "--nnodes", "1", "--nproc-per-node", "2",
                           "--node-rank", "0", "--master-addr", "127.0.0.1", "--script", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 4 and "[pod] rank 1 exited with code 4" in done.stdout, done.stdout + done.stderr
