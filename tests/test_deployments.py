"""prefect.yaml and the Kubernetes work pool's job template (no cluster runs here: the rendered
manifest is what a worker would submit)."""

import json
import re
import tomllib
from pathlib import Path

import yaml

from megatrain.config.campaign import load_campaign

ROOT = Path(__file__).resolve().parents[1]


def deployments() -> dict[str, dict]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def test_every_deployment_points_at_a_flow_and_a_valid_campaign():
    import importlib

    for deployment in deployments().values():
        path, name = deployment["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        assert callable(getattr(importlib.import_module(module), name))
        load_campaign(ROOT / deployment["parameters"]["campaign_path"])


def test_local_and_cluster_pools_schedule_and_rollback_trigger():
    d = deployments()
    assert d["local"]["work_pool"]["name"] == "megatrain-local"
    cluster = d["cluster"]
    assert cluster["work_pool"]["name"] == "megatrain-k8s" and cluster["work_pool"]["job_variables"]["gpu_count"] == 8
    assert cluster["schedules"][0]["interval"] >= 3600 and cluster["concurrency_limit"]["limit"] == 1
    (trigger,) = d["self-check-on-anomaly"]["triggers"]
    assert trigger["expect"] == ["megatrain.anomaly.*"]


def test_kubernetes_job_template_requests_gpus_shared_memory_and_nodes():
    from prefect.utilities.templating import apply_values

    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    values = {**defaults, **deployments()["cluster"]["work_pool"]["job_variables"], "name": "gpt-175b-main",
              "command": ["python", "-m", "flows.pretrain"], "image": "registry/megatrain:1"}
    job = apply_values(template["job_configuration"], values)["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "registry/megatrain:1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["restartPolicy"] == "Never"


def test_a_multi_node_stage_renders_as_an_indexed_job_with_rendezvous():
    from tasks.kubernetes import stage_manifests

    campaign = load_campaign(ROOT / "configs/campaign-cluster.yaml")
    config_map, service, job = stage_manifests(campaign, 0, attempt=3, config_yaml="name: x\n", image="registry/megatrain:1")
    name = job["metadata"]["name"]
    assert config_map["data"]["config.yaml"] == "name: x\n" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 1536
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == name
    (container,) = pod["containers"]
    command = container["command"][-1]
    assert "--nnodes 1536 --nproc-per-node 8 --node-rank $JOB_COMPLETION_INDEX" in command
    assert f"--master-addr {name}-0.{name}" in command and "--config /etc/megatrain/config.yaml" in command
    # no torchrun agent, whose TCP store would listen to every pod unauthenticated: the ranks meet in Redis
    assert command.startswith("exec python -m megatrain.launch.pod ") and "torch.distributed.run" not in command
    from megatrain.config.campaign import stage_config

    assert all(stage_config(campaign, i).parallel.init.store == "redis" for i in range(len(campaign.stages)))
    assert {"name": "MEGATRAIN_KEEPER_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert len(name) <= 52 and name == name.lower()


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_cluster_image_installs_like_the_makefile_and_holds_what_the_pods_run():
    """No Docker engine runs here: the Dockerfile is checked against the files it must agree with."""
    steps = dockerfile()
    run = " ".join(args for op, args in steps if op == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"pip install -q (torch==\S+)", makefile).group(1)
    assert f"pip install -q {torch_pin}" in run  # the same torch, first, as the Makefile
    extras = re.search(r"--no-build-isolation -e '\.\[([a-z0-9,]+)\]'", run).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"flows", "s3", "cluster"} <= set(extras) <= set(declared)
    assert "kubernetes" in " ".join(declared["cluster"])  # tasks/kubernetes.py creates the stage Jobs

    workdir = [args for op, args in steps if op == "WORKDIR"][-1]
    cluster = deployments()["cluster"]
    assert cluster["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == workdir
    assert cluster["work_pool"]["job_variables"]["env"]["MEGATRAIN_ROOT"] == workdir
    copied = [args.split() for op, args in steps if op == "COPY"]
    for *sources, _ in copied:
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    sources = {source.rstrip("/") for *group, _ in copied for source in group}
    entry_dir = cluster["entrypoint"].split("/")[0]
    assert {entry_dir, "megatrain", "tasks", "configs"} <= sources  # the flow, the ranks' module, the recipes
    load_campaign(ROOT / cluster["parameters"]["campaign_path"])
    # The work pool passes `prefect flow-run execute` as the container's args: no ENTRYPOINT may eat them.
    assert not [args for op, args in steps if op == "ENTRYPOINT"]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".prefect", "runs", ".venv", ".git"} <= set(ignored)
    assert re.search(r"^image:\n\tdocker build -t \$\(IMAGE\) \.$", makefile, re.M)


def test_the_cluster_deployment_is_registered_only_with_an_image():
    serve = (ROOT / "scripts/serve.sh").read_text()
    image = deployments()["cluster"]["work_pool"]["job_variables"]["image"]
    assert image == "{{ $MEGATRAIN_IMAGE }}"
    # serve.sh adds `--name cluster` only inside the MEGATRAIN_IMAGE branch (tests/scripts runs it with one)
    branch = serve[serve.index('if [ -n "${MEGATRAIN_IMAGE:-}" ]'):serve.index("fi", serve.index('if [ -n "${MEGATRAIN_IMAGE:-}" ]'))]
    assert "--name cluster" in branch and serve.count("--name cluster") == 1
    assert "deploy --all" not in serve
