"""infra/terraform lets no one in where they don't belong: every Service has a NetworkPolicy, no
password is a literal, Redis requires the generated password and every pod that talks to it loads
it, the Prefect server and worker use basic auth from a secret, and Dask speaks TLS only."""

import json
import re

import hcl2
import pytest
from test_terraform import (
    ROOT,
    TF,
    blocks,
    container,
    resolve_labels,
    tf_locals,
    unquote,
)

from megatrain.config.campaign import load_campaign
from tasks.kubernetes import REDIS_SECRET, stage_manifests


@pytest.fixture(scope="module")
def tf() -> dict[str, dict]:
    return {f.name: hcl2.loads(f.read_text()) for f in sorted(TF.glob("*.tf"))}


@pytest.fixture(scope="module")
def stage_objects() -> list[dict]:
    return stage_manifests(load_campaign(ROOT / "configs/campaign-cluster.yaml"), 0, 1, "model: {}\n", "megatrain:test")


def _policies(tf) -> dict[str, dict]:
    return {key: body for key, body in blocks(tf, "resource").items()
            if key.startswith("kubernetes_network_policy_v1.")}


def _selected(tf, policy: dict) -> dict:
    selector = policy["spec"][0]["pod_selector"][0]
    return resolve_labels(tf, selector["match_labels"]) if "match_labels" in selector else {}  # {}: every pod


def _covered(tf, pod_labels: dict) -> list[str]:
    """The policies (other than the namespace's default deny) that select pods with these labels."""
    return [key for key, policy in _policies(tf).items()
            if (selected := _selected(tf, policy)) and selected.items() <= pod_labels.items()]


def test_nothing_is_reachable_unless_a_policy_lets_it_in(tf):
    deny = _policies(tf)["kubernetes_network_policy_v1.default_deny"]["spec"][0]
    assert "match_labels" not in deny["pod_selector"][0] and deny["policy_types"] == ['"Ingress"'] and "ingress" not in deny


def test_every_service_has_a_network_policy(tf, stage_objects):
    services = {key: resolve_labels(tf, body["spec"][0]["selector"])
                for key, body in blocks(tf, "resource").items() if key.startswith("kubernetes_service_v1.")}
    assert services, "no Service found"
    # the stage's headless rendezvous Service selects the rank pods tasks/kubernetes.py makes
    job = next(m for m in stage_objects if m["kind"] == "Job")
    services["rank pods (tasks/kubernetes.py)"] = job["spec"]["template"]["metadata"]["labels"]
    services["prefect-server (chart)"] = {"app.kubernetes.io/name": "prefect-server"}
    for name, labels in services.items():
        assert _covered(tf, labels), f"{name}: no NetworkPolicy selects its pods {labels}"


def test_campaign_services_accept_only_the_campaigns_own_pods(tf, stage_objects):
    member = {"app.kubernetes.io/part-of": "megatrain"}
    for key in ("redis", "dask_scheduler", "dask_workers", "ranks"):
        (rule,) = _policies(tf)[f"kubernetes_network_policy_v1.{key}"]["spec"][0]["ingress"]
        sources = [resolve_labels(tf, f["pod_selector"][0]["match_labels"]) for f in rule["from"]]
        assert sources == [member] and all("namespace_selector" not in f for f in rule["from"]), key
    # ... and the pods that must get in carry that label: flow runs and ranks
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    assert template["job_configuration"]["job_manifest"]["spec"]["template"]["metadata"]["labels"] == member
    job = next(m for m in stage_objects if m["kind"] == "Job")
    assert member.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_the_prefect_server_accepts_its_worker_the_flow_runs_and_the_ingress_only(tf):
    (rule,) = _policies(tf)["kubernetes_network_policy_v1.prefect_server"]["spec"][0]["ingress"]
    sources = [resolve_labels(tf, f["pod_selector"][0]["match_labels"]) if "pod_selector" in f
               else {"namespace": f["namespace_selector"][0]["match_labels"]} for f in rule["from"]]
    assert sources == [{"app.kubernetes.io/name": "prefect-worker"}, {"app.kubernetes.io/part-of": "megatrain"},
                       {"namespace": {'"kubernetes.io/metadata.name"': "${var.ingress_namespace}"}}]
    assert [p["port"] for p in rule["ports"]] == [4200]


# A quoted literal assigned to a name that holds a secret: `password = "x"`, `requirepass "x"`, an
# auth string "admin:x". References (${...}) and empty strings are fine.
LITERAL_SECRET = re.compile(
    r'(?i)(password|passwd|secret|token|auth_?string|api_?key)[a-z_"]*\s*=\s*"(?![^"]*\$\{)[^"]+"'
    r'|requirepass\s+[^$\s]|"admin:(?![^"]*\$\{)[^"]*"')


def test_no_password_is_a_literal(tf):
    for path in sorted(TF.glob("*.tf")) + [ROOT / "infra/k8s/base-job-template.json"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            assert not LITERAL_SECRET.search(code), f"{path.name}:{number}: a literal secret: {line.strip()}"
    for key, secret in blocks(tf, "resource").items():
        if key.startswith("kubernetes_secret_v1."):
            data = secret["data"]
            values = [data] if isinstance(data, str) else list(data.values())
            assert all("${" in str(v) for v in values), f"{key}: a literal value"  # each made from a reference
    for name, variable in blocks(tf, "variable").items():  # no default credential either
        if re.search(r"password|secret|token|auth", name):
            assert variable.get("default") in (None, '""'), name


def test_the_literal_check_can_fail():
    for bad in ('password = "hunter2"', 'requirepass hunter2', 'auth_string = "admin:pw"', '"admin:pw"'):
        assert LITERAL_SECRET.search(bad), bad
    for good in ('password = "${random_password.redis.result}"', "requirepass $MEGATRAIN_REDIS_PASSWORD",
                 '"auth-string" = "admin:${random_password.prefect_ui.result}"'):
        assert not LITERAL_SECRET.search(good), good


def test_redis_requires_the_generated_password_and_its_clients_load_it(tf, stage_objects):
    resources = blocks(tf, "resource")
    secret = resources["kubernetes_secret_v1.redis_auth"]
    assert unquote(secret["metadata"][0]["name"]) == REDIS_SECRET
    assert secret["data"] == {"MEGATRAIN_REDIS_PASSWORD": "${random_password.redis.result}"}
    redis = container(resources["kubernetes_deployment_v1.redis"])
    script = " ".join(redis["command"])
    assert "requirepass $MEGATRAIN_REDIS_PASSWORD" in script and "redis-server -" in script  # on stdin, not argv
    assert redis["env_from"][0]["secret_ref"][0]["name"] == "${kubernetes_secret_v1.redis_auth.metadata[0].name}"
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    flow_pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    job = next(m for m in stage_objects if m["kind"] == "Job")
    for pod in (flow_pod, job["spec"]["template"]["spec"]["containers"][0]):
        assert {"secretRef": {"name": REDIS_SECRET}} in pod["envFrom"]  # required: no password, no start


def test_prefect_server_and_worker_use_basic_auth_from_the_secret(tf):
    resources = blocks(tf, "resource")
    secret = resources["kubernetes_secret_v1.prefect_auth"]
    assert {unquote(k) for k in secret["data"]} == {"auth-string", "PREFECT_API_AUTH_STRING",
                                                    "PREFECT_SERVER_API_AUTH_STRING"}
    ref = "kubernetes_secret_v1.prefect_auth.metadata[0].name"  # inside yamlencode(): a bare reference
    server_values = resources["helm_release.prefect_server"]["values"][0]
    worker_values = resources["helm_release.prefect_worker"]["values"][0]
    for values in (server_values, worker_values):
        assert re.search(r"basicAuth\s*=\s*\{\s*enabled\s*=\s*true,\s*existingSecret\s*=\s*" + re.escape(ref), values)
    template = json.loads((ROOT / "infra/k8s/base-job-template.json").read_text())
    flow_pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "megatrain-prefect-auth", "optional": True}} in flow_pod["envFrom"]
    assert blocks(tf, "output")["prefect_ui_password"]["sensitive"] is True


def test_dask_speaks_tls_only(tf):
    resources = blocks(tf, "resource")
    for key in ("kubernetes_deployment_v1.dask_scheduler", "kubernetes_deployment_v1.dask_worker"):
        command = " ".join(container(resources[key])["command"])
        for flag in ("--tls-ca-file", "--tls-cert", "--tls-key"):
            assert flag in command, (key, flag)
    assert unquote(tf_locals(tf)["dask_scheduler_address"]).startswith("tls://")
    client = resources["kubernetes_config_map_v1.dask_client"]["data"]
    assert client["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == '"true"'
    tls = resources["kubernetes_secret_v1.dask_tls"]["data"]
    assert {unquote(k) for k in tls} == {"ca.pem", "tls.crt", "tls.key"}
