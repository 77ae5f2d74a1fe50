"""deploy/kubernetes: the kustomize base (workers and the HTTP gateway), the GPU overlay and the Redis Cluster
component, validated offline.

Kubernetes' own kinds go through kubernetes-validate (the API's JSON schemas, strict: an unknown field fails);
KEDA's ScaledObject and TriggerAuthentication and the Prometheus Operator's ServiceMonitor through the schemas
of their CRDs vendored in tests/data/crd-schemas, made strict the same way. `kubectl kustomize` renders the
overlay where kubectl is installed. What KEDA watches is checked against producer.protocol itself.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from producer import protocol as p
from producer.gateway.settings import GatewaySettings
from worker.loop import SHUTDOWN_GRACE_S
from worker.settings import WorkerSettings

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate, in the "
                                  "dev extra), so the manifests cannot be validated")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BASE, GPU, CLUSTER = K8S / "base", K8S / "overlays" / "gpu", K8S / "components" / "redis-cluster"
SCHEMAS = Path(__file__).parent / "data" / "crd-schemas"
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
               ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_triggerauthentications.yaml",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml"}
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed, so the kustomizations "
                                                           "cannot be rendered (the files are validated alone)")


def strict(schema):
    """A CRD schema as the API server applies it with strict field validation: unknown fields are errors."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@lru_cache(maxsize=None)
def crd_validator(filename: str) -> jsonschema.Validator:
    schema = strict(copy.deepcopy(yaml.safe_load((SCHEMAS / filename).read_text())))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(resource: dict) -> None:
    """Raise if the resource breaks its kind's schema."""
    crd = CRD_SCHEMAS.get((resource["apiVersion"], resource["kind"]))
    if crd is not None:
        crd_validator(crd).validate(resource)
    else:
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


def base_files() -> list[dict]:
    """The base's resources as written (no kustomize): one per file."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [yaml.safe_load((BASE / name).read_text()) for name in kustomization["resources"]
            if name.endswith(".yaml")]


WORKER, GATEWAY = "redline-worker", "redline-gateway"


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    [found] = [r for r in resources if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    return found


def env_file(name: str) -> dict[str, str]:
    lines = (BASE / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def worker_env() -> dict[str, str]:
    return env_file("worker.env")


def kustomize(path: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    if KUBECTL is None:
        pytest.skip(needs_kubectl.kwargs["reason"])
    return kustomize(GPU)


def triggers(scaled_object: dict) -> dict[str, dict]:
    return {t["name"]: t for t in scaled_object["spec"]["triggers"]}


# -- validation ----------------------------------------------------------------------------------------------

def test_every_base_manifest_passes_its_schema():
    resources = base_files()
    assert {r["kind"] for r in resources} == {"Deployment", "Service", "ServiceMonitor", "ScaledObject",
                                              "TriggerAuthentication"}
    for resource in resources:
        validate(resource)


@pytest.mark.parametrize("kind, path, typo", [
    ("Deployment", ["spec", "template", "spec"], "terminationGracePeriodSecond"),
    ("ScaledObject", ["spec"], "minReplicaCounts"),
    ("ServiceMonitor", ["spec", "endpoints", 0], "intervall"),
    ("TriggerAuthentication", ["spec", "secretTargetRef", 0], "parametre"),
])
def test_the_validators_reject_a_misspelt_field(kind, path, typo):
    resource = copy.deepcopy(one(base_files(), kind, WORKER if kind in ("Deployment", "ServiceMonitor") else None))
    node = resource
    for step in path:
        node = node[step]
    node[typo] = 1
    with pytest.raises(jsonschema.ValidationError, match=typo):
        validate(resource)


@needs_kubectl
def test_kustomize_renders_the_gpu_overlay_and_every_object_validates(rendered):
    kinds = sorted(r["kind"] for r in rendered)
    assert kinds == sorted(["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Deployment", "Service", "Service",
                            "ServiceMonitor", "ServiceMonitor", "ScaledObject", "TriggerAuthentication"])
    for resource in rendered:
        validate(resource)
    pod = one(rendered, "Deployment", WORKER)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # the generated ConfigMap (its name carries a content hash) is the one the worker reads
    settings = next(r for r in rendered if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith(
        "redline-worker-"))
    assert container["envFrom"] == [{"configMapRef": {"name": settings["metadata"]["name"]}}]
    assert settings["data"] == worker_env()


@needs_kubectl
def test_the_redis_cluster_component_moves_the_workers_the_gateway_and_keda_to_the_cluster_together(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(GPU, tmp_path)], "components": [os.path.relpath(CLUSTER, tmp_path)]}))
    resources = kustomize(tmp_path)
    for resource in resources:
        validate(resource)
    urls = {r["metadata"]["name"].rsplit("-", 1)[0]: r["data"]["REDLINE_REDIS_URL"] for r in resources
            if r["kind"] == "ConfigMap" and "REDLINE_REDIS_URL" in r.get("data", {})}
    assert set(urls) == {WORKER, GATEWAY} and len(set(urls.values())) == 1
    url = urls[WORKER]
    assert url.startswith("redis+cluster://")
    for trigger in one(resources, "ScaledObject")["spec"]["triggers"]:
        assert trigger["type"] == "redis-cluster-streams" and "address" not in trigger["metadata"]
        assert trigger["metadata"]["addresses"] == urlsplit(url).netloc.rpartition("@")[2]


# -- what KEDA watches ---------------------------------------------------------------------------------------

def test_keda_watches_the_workers_group_on_every_priority_stream_of_the_workers_queue():
    scaled = one(base_files(), "ScaledObject")
    keys = p.Keys(worker_env()["REDLINE_QUEUE"])
    by_name = triggers(scaled)
    waiting = {n: t for n, t in by_name.items() if "lagCount" in t["metadata"]}
    running = {n: t for n, t in by_name.items() if "pendingEntriesCount" in t["metadata"]}
    assert len(waiting) + len(running) == len(by_name)
    for group in (waiting, running):
        assert sorted(t["metadata"]["stream"] for t in group.values()) == sorted(keys.all_jobs())
        assert {t["metadata"]["consumerGroup"] for t in group.values()} == {p.GROUP}
    assert all(t["metadata"]["activationLagCount"] == "0" for t in waiting.values())  # one job wakes a worker
    for trigger in by_name.values():
        assert trigger["type"] == "redis-streams" and trigger["metricType"] == "AverageValue"  # fallback needs it
        assert trigger["authenticationRef"] == {"name": one(base_files(), "TriggerAuthentication")["metadata"]["name"]}
        # KEDA reads the Redis the workers use
        assert trigger["metadata"]["address"] == urlsplit(worker_env()["REDLINE_REDIS_URL"]).netloc
    modifiers = scaled["spec"]["advanced"]["scalingModifiers"]
    # the HPA sees one metric: every trigger summed, per worker
    assert sorted(re.split(r"\s*\+\s*", modifiers["formula"].strip())) == sorted(by_name)
    assert modifiers["metricType"] == "AverageValue" and int(modifiers["target"]) > 0
    assert modifiers["activationTarget"] == "0"
    spec = scaled["spec"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
    assert spec["scaleTargetRef"]["name"] == one(base_files(), "Deployment", WORKER)["metadata"]["name"]


def test_keda_and_the_workers_read_the_same_redis_password():
    auth = one(base_files(), "TriggerAuthentication")["spec"]["secretTargetRef"]
    [container] = one(base_files(), "Deployment", WORKER)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    secret = env["REDLINE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert auth == [{"parameter": "password", "name": secret["name"], "key": secret["key"]}]
    assert "redis_password" in WorkerSettings.model_fields


# -- the worker pods -----------------------------------------------------------------------------------------

def test_every_configured_variable_is_a_worker_setting():
    for name in worker_env():
        assert name.startswith("REDLINE_") and name.removeprefix("REDLINE_").lower() in WorkerSettings.model_fields, \
            f"{name} in worker.env is not a `redline worker` setting"


def test_the_worker_is_probed_on_its_health_endpoints_and_outlasts_its_drain():
    deployment = one(base_files(), "Deployment", WORKER)
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = worker_env()
    [port] = container["ports"]
    assert port["containerPort"] == int(env["REDLINE_METRICS_PORT"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    # SIGTERM drains for REDLINE_DRAIN_TIMEOUT, then the last writes retry SHUTDOWN_GRACE_S: all before SIGKILL
    assert pod["terminationGracePeriodSeconds"] >= float(env["REDLINE_DRAIN_TIMEOUT"]) + SHUTDOWN_GRACE_S + 20
    assert "lifecycle" not in container  # no preStop: it would only hold back the drain SIGTERM starts
    assert "replicas" not in deployment["spec"]  # KEDA owns the count
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_prometheus_scrapes_the_workers_under_the_job_the_dashboards_select():
    resources = base_files()
    service, monitor = one(resources, "Service", WORKER), one(resources, "ServiceMonitor", WORKER)
    pod_labels = one(resources, "Deployment", WORKER)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # the job label of a ServiceMonitor's series is the Service's name; the dashboards count `up` of that job
    compose_job = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())["scrape_configs"][0]["job_name"]
    assert service["metadata"]["name"] == compose_job
    dashboards = " ".join(f.read_text() for f in (ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json"))
    assert f'job=\\"{compose_job}\\"' in dashboards


def test_prometheus_scrapes_the_gateways_under_the_job_the_dashboards_select():
    resources = base_files()
    service, monitor = one(resources, "Service", GATEWAY), one(resources, "ServiceMonitor", GATEWAY)
    worker_service = one(resources, "Service", WORKER)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= worker_service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    jobs = [c["job_name"] for c in yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())["scrape_configs"]]
    assert GATEWAY in jobs  # compose scrapes it under the Service's name, the job a ServiceMonitor's series get
    dashboards = " ".join(f.read_text() for f in (ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json"))
    assert f'job=\\"{GATEWAY}\\"' in dashboards


def test_the_dashboards_configmap_carries_every_dashboard_file():
    kustomization = yaml.safe_load((ROOT / "monitoring" / "grafana" / "kustomization.yaml").read_text())
    [generator] = kustomization["configMapGenerator"]
    dashboards = sorted(f"dashboards/{f.name}" for f in (ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json"))
    assert sorted(generator["files"]) == dashboards
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}


@needs_kubectl
def test_the_rendered_dashboards_are_the_files(rendered):
    configmap = next(r for r in rendered if r["metadata"]["name"] == "redline-dashboards")
    for name, text in configmap["data"].items():
        assert text == (ROOT / "monitoring" / "grafana" / "dashboards" / name).read_text()


# -- the gateway ---------------------------------------------------------------------------------------------

def test_the_gateway_serves_the_workers_queue_with_its_own_settings():
    env = env_file("gateway.env")
    for name in env:
        assert name.startswith("REDLINE_") and name.removeprefix("REDLINE_").lower() in GatewaySettings.model_fields, \
            f"{name} in gateway.env is not a `redline serve` setting"
    for name in ("REDLINE_REDIS_URL", "REDLINE_QUEUE"):
        assert env[name] == worker_env()[name]
    assert env["REDLINE_MODEL_NAME"] == worker_env()["REDLINE_MODEL"]
    settings = GatewaySettings(**{k.removeprefix("REDLINE_").lower(): v for k, v in env.items()})
    deployment = one(base_files(), "Deployment", GATEWAY)
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["redline", "serve"] and settings.host == "0.0.0.0"
    assert container["envFrom"] == [{"configMapRef": {"name": GATEWAY}}]
    [port] = container["ports"]
    assert port["containerPort"] == settings.port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert "limits" not in container["resources"]  # no GPU
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    [worker] = one(base_files(), "Deployment", WORKER)["spec"]["template"]["spec"]["containers"]
    assert secrets["REDLINE_REDIS_PASSWORD"] == next(e for e in worker["env"] if e["name"] == "REDLINE_REDIS_PASSWORD"
                                                     )["valueFrom"]["secretKeyRef"]
    assert secrets["REDLINE_API_KEYS"]["optional"] is True and "api_keys" in GatewaySettings.model_fields
    assert pod["terminationGracePeriodSeconds"] > 30  # uvicorn's graceful shutdown


def test_the_gateway_service_reaches_only_gateway_pods():
    resources = base_files()
    service = one(resources, "Service", GATEWAY)
    gateway_labels = one(resources, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    worker_labels = one(resources, "Deployment", WORKER)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= gateway_labels.items()
    assert not service["spec"]["selector"].items() <= worker_labels.items()
    # the workers' Service and ServiceMonitor do not take the gateway's pods or Service
    assert not one(resources, "Service", WORKER)["spec"]["selector"].items() <= gateway_labels.items()
    monitor = one(resources, "ServiceMonitor", WORKER)["spec"]["selector"]["matchLabels"]
    assert not monitor.items() <= service["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    [container] = one(resources, "Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] == container["ports"][0]["name"]
