"""A multi-node stage on Kubernetes: one indexed Job whose pods are the stage's nodes.

A Prefect flow run on the Kubernetes work pool is itself one pod; the stage's ranks need
``nnodes`` pods of ``nproc_per_node`` GPUs each, started together. This renders the objects for
that (a ConfigMap with the stage's resolved config, a headless Service for rendezvous DNS, an
Indexed Job running torchrun with ``--node-rank`` from the completion index) and submits them
with the ``kubernetes`` client when it is installed. No cluster runs in this repository's tests:
they check the rendered manifests.
"""

from __future__ import annotations

import time

from prefect import task

from megatrain.config.campaign import CampaignConfig
from tasks._log import run_logger

RDZV_PORT = 29500
# Credentials of the durable store (S3 keys, HDFS user...: megatrain.storage reads them from the
# environment), as a Secret every rank loads when it exists (infra/terraform/storage.tf makes it).
STORAGE_SECRET = "megatrain-storage"


def _name(campaign: CampaignConfig, index: int, attempt: int) -> str:
    raw = f"mt-{campaign.id}-{campaign.stages[index].name}-{attempt}".lower()
    return "".join(c if c.isalnum() or c == "-" else "-" for c in raw)[:52].strip("-")


def stage_manifests(campaign: CampaignConfig, index: int, attempt: int, config_yaml: str, image: str,
                    namespace: str = "megatrain", node_selector: dict[str, str] | None = None,
                    shm_size: str = "64Gi") -> list[dict]:
    """ConfigMap + headless Service + Indexed Job for one attempt of one stage."""
    name = _name(campaign, index, attempt)
    labels = {"app.kubernetes.io/name": "megatrain", "megatrain/campaign": campaign.id[:63],
              "megatrain/stage": campaign.stages[index].name[:63], "megatrain/job": name}
    torchrun = (
        f"exec python -m torch.distributed.run --nnodes {campaign.nnodes} --nproc-per-node {campaign.nproc_per_node} "
        f"--node-rank $JOB_COMPLETION_INDEX --master-addr {name}-0.{name} --master-port {RDZV_PORT} "
        f"-m megatrain.train --config /etc/megatrain/config.yaml"
    )
    gpus = campaign.nproc_per_node
    pod_spec = {
        "subdomain": name,  # pods resolve as <job>-<index>.<service>
        "restartPolicy": "Never",
        "nodeSelector": node_selector or {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{
            "name": "ranks", "image": image, "command": ["bash", "-c", torchrun],
            "ports": [{"containerPort": RDZV_PORT}],
            "envFrom": [{"secretRef": {"name": STORAGE_SECRET, "optional": True}}],
            "resources": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}},
            "volumeMounts": [{"name": "config", "mountPath": "/etc/megatrain"}, {"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [
            {"name": "config", "configMap": {"name": name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        ],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "data": {"config.yaml": config_yaml}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "spec": {"clusterIP": "None", "selector": {"megatrain/job": name},
                  "ports": [{"name": "rdzv", "port": RDZV_PORT}]}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "spec": {"completionMode": "Indexed", "completions": campaign.nnodes, "parallelism": campaign.nnodes,
                  "backoffLimit": 0,  # one failed node fails the attempt; the stage task decides what next
                  "template": {"metadata": {"labels": labels}, "spec": pod_spec}}},
    ]


@task(name="launch-kubernetes-job", retries=0)
def launch_kubernetes_job(manifests: list[dict], timeout_s: float, poll_s: float = 10.0) -> dict:
    """Create the objects, wait for the Job to succeed or fail, delete them. Hangs are caught by
    the heartbeat watcher the stage task runs against the Redis sink."""
    from kubernetes import client, config, utils  # optional: only the cluster needs it

    config.load_incluster_config()
    api = client.ApiClient()
    job = next(m for m in manifests if m["kind"] == "Job")
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    for manifest in manifests:
        utils.create_from_dict(api, manifest, namespace=namespace)
    batch, start = client.BatchV1Api(api), time.monotonic()
    try:
        while time.monotonic() - start < timeout_s:
            status = batch.read_namespaced_job_status(name, namespace).status
            if status.succeeded == job["spec"]["completions"]:
                return {"status": "completed", "returncode": 0, "message": "", "verdict": None}
            if status.failed:
                return {"status": "crashed", "returncode": 1, "message": f"job {name}: {status.failed} pod(s) failed",
                        "verdict": None}
            time.sleep(poll_s)
        return {"status": "timeout", "returncode": None, "message": f"job {name} exceeded {timeout_s:.0f} s", "verdict": None}
    finally:
        run_logger().info("deleting job %s", name)
        batch.delete_namespaced_job(name, namespace, propagation_policy="Foreground")
        client.CoreV1Api(api).delete_namespaced_service(name, namespace)
        client.CoreV1Api(api).delete_namespaced_config_map(name, namespace)
