"""Kubernetes parity: the pretrain/cluster Job rendered for 4 nodes starts each node's ranks with the
command the hosts backend starts inside each host (megatrain.launch.pod, same arguments but for the
rendezvous name), and both use the same mechanisms: ranks meeting in Redis (no TCP store), the
keepers' peer port on the node's own address, a private /dev/shm."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.launch import host_init, nodes

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "/etc/megatrain/config.yaml"


def test_the_rendered_job_for_4_nodes_runs_what_the_hosts_run():
    from tasks.kubernetes import RDZV_PORT, stage_manifests

    cluster_campaign = load_campaign(ROOT / "configs/campaign-cluster.yaml")
    campaign = cluster_campaign.model_copy(update={"nnodes": 4, "nproc_per_node": 2})  # rendered only
    _, _, job = stage_manifests(campaign, 0, attempt=1, config_yaml="name: x\n", image="megatrain:test")
    name = job["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    rendered = shlex.split(container["command"][-1])
    assert rendered[0] == "exec" and job["spec"]["completions"] == 4
    for index in range(4):
        pod = [index if word == "$JOB_COMPLETION_INDEX" else word for word in rendered[1:]]
        pod = [str(word) for word in pod]
        hosts_side = nodes.pod_command(CONFIG, 4, 2, index, "MASTER", RDZV_PORT, [])
        hosts_side[0] = "python"  # the interpreter: the image's, this machine's venv's
        pod[pod.index("--master-addr") + 1] = "MASTER"  # the rendezvous' name: <job>-0.<job> / node0's address
        assert pod == hosts_side, (pod, hosts_side)
    assert f"--master-addr {name}-0.{name}" in container["command"][-1]
    # the same mechanisms: the store in Redis, no TCP store listening ...
    assert stage_config(cluster_campaign, 0).parallel.init.store == "redis"
    assert '"parallel.init.store=redis"' in (ROOT / "megatrain/launch/nodes.py").read_text()  # hosts_overrides
    assert hosts_side[hosts_side.index("-m") + 1] == "megatrain.launch.pod"
    # ... the keepers' peer port on the node's own address ...
    assert {"name": "MEGATRAIN_KEEPER_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in container["env"]
    assert "MEGATRAIN_KEEPER_HOST=address" in (ROOT / "megatrain/launch/nodes.py").read_text()
    # ... and a /dev/shm of the node's own: an emptyDir in memory, a tmpfs of the host's mount namespace
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert '_mount("tmpfs", "/dev/shm", "tmpfs"' in Path(host_init.__file__).read_text()
