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

from megatrain.config.campaign import load_campaign
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
    assert container["envFrom"] == [{"secretRef": {"name": name, "optional": True}}]
    job = next(m for m in stage_objects if m["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": name, "optional": True}}]
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
