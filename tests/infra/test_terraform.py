"""infra/terraform parses, and agrees with the names the rest of the repository relies on.

The providers cannot be downloaded here, so ``terraform validate`` cannot run; these checks
parse every file with python-hcl2 and compare what the cluster gets with what the code expects.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest
import yaml

from megatrain.config.campaign import load_campaign, stage_config
from tasks.kubernetes import STORAGE_SECRET, stage_manifests

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "infra" / "terraform"


def unquote(value):
    """python-hcl2 keeps string literals quoted ('"x"'); expressions come as '${...}'."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


@pytest.fixture(scope="module")
def tf() -> dict[str, dict]:
    """File name -> parsed HCL, for every .tf file."""
    files = sorted(TF.glob("*.tf"))
    assert files, f"no .tf files in {TF}"
    return {f.name: hcl2.loads(f.read_text()) for f in files}


@pytest.fixture(scope="module")
def stage_objects() -> list[dict]:
    """What tasks/kubernetes.py submits for one stage of the cluster campaign."""
    return stage_manifests(load_campaign(ROOT / "configs/campaign-cluster.yaml"), 0, 1, "model: {}\n", "megatrain:test")


def blocks(tf: dict, kind: str) -> dict[str, dict]:
    """'type.name' (resources) or 'name' (variables, outputs) -> block body, over all files."""
    out = {}
    for parsed in tf.values():
        for entry in parsed.get(kind, []):
            for label, body in entry.items():
                if kind == "resource":
                    for name, inner in body.items():
                        out[f"{unquote(label)}.{unquote(name)}"] = inner
                else:
                    out[unquote(label)] = body
    return out


def defaults(tf: dict) -> dict:
    return {name: unquote(body.get("default")) for name, body in blocks(tf, "variable").items()}


def test_every_variable_is_declared_and_used(tf):
    text = "\n".join(f.read_text() for f in TF.glob("*.tf"))
    used = set(re.findall(r"\bvar\.([a-z_][a-z0-9_]*)", text))
    declared = set(blocks(tf, "variable"))
    assert used - declared == set(), "used but not declared"
    assert declared - used == set(), "declared but never used"


def test_names_match_the_job_template_prefect_yaml_and_the_campaign(tf):
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())["variables"]["properties"]
    var = defaults(tf)
    assert var["namespace"] == template["namespace"]["default"]
    assert var["service_account"] == template["service_account_name"]["default"]

    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    cluster = next(d for d in deployments if d["name"] == "cluster")
    assert var["work_pool_name"] == cluster["work_pool"]["name"]

    campaign = yaml.safe_load((ROOT / "configs/campaign-cluster.yaml").read_text())
    redis_url = next(o.split("=", 1)[1] for o in campaign["overrides"] if o.startswith("reliability.redis_url="))
    host, port = re.match(r"redis://([^:/]+):(\d+)/", redis_url).groups()
    redis_locals = next(entry for parsed in tf.values() for entry in parsed.get("locals", []) if "redis_name" in entry)
    assert unquote(redis_locals["redis_name"]) == host and int(redis_locals["redis_port"]) == int(port)
    assert blocks(tf, "resource")["kubernetes_service_v1.redis"]["metadata"][0]["name"] == "${local.redis_name}"


def test_storage_secret_is_the_one_flow_runs_and_ranks_load(tf, stage_objects):
    secret = blocks(tf, "resource")["kubernetes_secret_v1.storage"]
    name = unquote(secret["metadata"][0]["name"])
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"][0] == {"secretRef": {"name": name, "optional": True}}  # then Redis's etc.
    job = next(m for m in stage_objects if m["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["envFrom"][0] == {"secretRef": {"name": name, "optional": True}}
    assert name == STORAGE_SECRET


def test_worker_reads_the_repository_job_template(tf):
    worker = blocks(tf, "resource")["helm_release.prefect_worker"]
    values = worker["values"][0]
    match = re.search(r'file\("\$\{path\.module\}/([^"]+)"\)', values)
    assert match, f"the worker's base job template is not read from a file: {values[:200]}"
    assert (TF / match.group(1)).resolve() == (ROOT / "infra/k8s/base-job-template.json").resolve()


def test_role_lets_flow_runs_submit_watch_and_delete_what_tasks_kubernetes_creates(tf, stage_objects):
    manifests = stage_objects
    role = blocks(tf, "resource")["kubernetes_role_v1.stage_jobs"]
    granted = {(unquote(g), unquote(r), unquote(v))
               for rule in role["rule"] for g in rule["api_groups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = set()
    for m in manifests:
        group = m["apiVersion"].rpartition("/")[0]  # "v1" -> core group ""
        resource = m["kind"].lower() + "s"
        needed |= {(group, resource, verb) for verb in ("create", "get", "delete")}
    needed.add(("batch", "jobs/status", "get"))  # launch_kubernetes_job polls the Job's status
    assert {m["kind"] for m in manifests} == {"ConfigMap", "Service", "Job"}
    assert needed - granted == set()


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform not installed (fmt check only)")
def test_terraform_fmt_is_clean():
    result = subprocess.run(["terraform", "fmt", "-check", "-recursive", "-diff", str(TF)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# The Dask cluster of the shard-data flow (dask.tf, data.engine=dask).

def tf_locals(tf: dict) -> dict:
    return {k: v for parsed in tf.values() for entry in parsed.get("locals", []) for k, v in entry.items()
            if not k.startswith("__")}


def resolve(value, names: dict):
    """A string with ${local.x} / ${<resource>.metadata[0].name} references, resolved from names."""
    value = unquote(value)
    if not isinstance(value, str):
        return value
    for _ in range(10):
        new = re.sub(r"\$\{([^}]+)\}", lambda m: str(unquote(names[m.group(1)])), value)
        if new == value:
            break
        value = unquote(new)
    return value


def names_of(tf: dict) -> dict:
    """'local.x' and 'var.x' (defaults) and every resource's 'type.name.metadata[0].name', for resolve()."""
    names = {f"local.{k}": v for k, v in tf_locals(tf).items()}
    names |= {f"var.{k}": v for k, v in defaults(tf).items()}
    for key, body in blocks(tf, "resource").items():
        if body.get("metadata"):
            names[f"{key}.metadata[0].name"] = body["metadata"][0].get("name")
    return names


def container(resource: dict) -> dict:
    (only,) = resource["spec"][0]["template"][0]["spec"][0]["container"]
    return only


def campaign_dask_address() -> str:
    campaign = yaml.safe_load((ROOT / "configs/campaign-cluster.yaml").read_text())
    overrides = dict(o.split("=", 1) for o in campaign["overrides"])
    assert overrides.get("data.engine") == "dask"
    return overrides["data.dask_address"]


def option(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{flag} not (once) in {command}"
    return command[command.index(flag) + 1]


def test_dask_scheduler_service_is_the_campaigns_dask_address(tf):
    address = campaign_dask_address()
    host, port = re.fullmatch(r"tls://([^:/]+):(\d+)", address).groups()  # TLS only (security.tf)
    names, resources = names_of(tf), blocks(tf, "resource")

    service = resources["kubernetes_service_v1.dask_scheduler"]
    assert resolve(service["metadata"][0]["name"], names) == host
    ports = {unquote(p["name"]): p for p in service["spec"][0]["port"]}
    assert int(resolve(ports["comm"]["port"], names)) == int(port)
    assert unquote(service["spec"][0].get("type", '"ClusterIP"')) == "ClusterIP"  # the dashboard stays inside

    scheduler = resources["kubernetes_deployment_v1.dask_scheduler"]
    assert service["spec"][0]["selector"] == scheduler["spec"][0]["template"][0]["metadata"][0]["labels"]
    assert scheduler["spec"][0]["replicas"] == 1
    command = [resolve(c, names) for c in container(scheduler)["command"]]
    assert command[:2] == ["dask", "scheduler"] and int(option(command, "--port")) == int(port)
    probe = container(scheduler)["readiness_probe"][0]["tcp_socket"][0]
    assert int(resolve(probe["port"], names)) == int(port)
    assert int(resolve(ports["comm"]["target_port"], names)) == int(port)

    assert resolve(blocks(tf, "output")["dask_address"]["value"], names) == address

    # and the campaign's stages get it (data.engine and data.dask_address are recipe fields)
    cfg = stage_config(load_campaign(ROOT / "configs/campaign-cluster.yaml"), 0)
    assert (cfg.data.engine, cfg.data.dask_address) == ("dask", address)


def test_dask_workers_are_single_threaded_against_the_scheduler(tf):
    names = names_of(tf)
    worker = blocks(tf, "resource")["kubernetes_deployment_v1.dask_worker"]
    spec = container(worker)
    command = [resolve(c, names) for c in spec["command"]]
    assert command[:3] == ["dask", "worker", campaign_dask_address()]
    assert option(command, "--nworkers") == "1" and option(command, "--nthreads") == "1"
    memory = spec["resources"][0]["limits"]["memory"]
    assert option(command, "--memory-limit") == resolve(memory, names)  # Dask acts before the OOM killer
    env = {unquote(e["name"]): unquote(e["value"]) for e in spec["env"]}
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["OMP_NUM_THREADS"] == "1"
    assert worker["spec"][0]["replicas"] == "${var.dask_workers}"
    assert "readiness_probe" in spec


def test_dask_workers_load_the_flow_pods_storage_secret(tf):
    names = names_of(tf)
    worker = blocks(tf, "resource")["kubernetes_deployment_v1.dask_worker"]
    (env_from,) = container(worker)["env_from"]
    (ref,) = env_from["secret_ref"]
    assert ref["name"] == "${kubernetes_secret_v1.storage.metadata[0].name}"
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    flow_pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert flow_pod["envFrom"][0] == {"secretRef": {"name": resolve(ref["name"], names), "optional": ref["optional"]}}


def test_dask_pods_run_the_megatrain_image_in_the_namespace(tf):
    resources = blocks(tf, "resource")
    for key in ("kubernetes_deployment_v1.dask_scheduler", "kubernetes_deployment_v1.dask_worker",
                "kubernetes_service_v1.dask_scheduler"):
        metadata = resources[key]["metadata"][0]
        assert metadata["namespace"] == "${kubernetes_namespace_v1.megatrain.metadata[0].name}", key
        labels = resolve_labels(tf, metadata["labels"])
        assert labels["app.kubernetes.io/part-of"] == "megatrain", key
        if key.startswith("kubernetes_deployment_v1"):
            assert container(resources[key])["image"] == "${var.megatrain_image}", key
    assert "default" not in blocks(tf, "variable")["megatrain_image"]  # no silent megatrain:latest


def resolve_labels(tf: dict, labels) -> dict:
    if isinstance(labels, str):
        labels = tf_locals(tf)[re.fullmatch(r"\$\{local\.([a-z0-9_]+)\}", labels).group(1)]
    return {unquote(k): unquote(v) for k, v in labels.items()}


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform not installed (evaluates the validation)")
def test_megatrain_image_must_be_pinned(tf, tmp_path):
    (validation,) = blocks(tf, "variable")["megatrain_image"]["validation"]
    condition = validation["condition"][2:-1]  # '${...}' -> the expression
    images = {"registry/megatrain:2026.11.1": "true", "registry:5000/megatrain:v1": "true",
              "registry/megatrain@sha256:" + "0" * 64: "true",
              "megatrain:latest": "false", "megatrain": "false", "registry:5000/megatrain": "false", "": "false"}
    for image, valid in images.items():  # one console per expression: piped, it reads one
        result = subprocess.run(["terraform", "console"], input=condition.replace("var.megatrain_image", json.dumps(image)),
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == valid, image
