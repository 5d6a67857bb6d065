"""The Kubernetes manifests and the Grafana dashboard under deploy/: what can be checked
without a cluster. Every YAML parses; the probes and the scrape path are routes the hub
serves; the ConfigMap's settings file (with the Deployment's environment) is accepted by the
hub's settings; the migration Job runs the Deployment's image with its config and database
Secret; the overlay renders (`kubectl kustomize`, where kubectl exists) with every reference
resolved; the dashboard only queries series the hub exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.units import parse_bytes
from benchmarks.launch.process import REPO
from hub.app import create_app
from hub.settings import HubSettings, load_settings

K8S = REPO / "deploy" / "kubernetes"
BASE, OVERLAY = K8S / "base", K8S / "overlays" / "example"
DASHBOARD = REPO / "deploy" / "grafana" / "model-hub.json"
SAMPLE_ENV = {  # what the downward API and the Secret would provide
    "POD_NAME": "hub-7d9f-abcde",
    "POD_IP": "10.0.0.7",
}
SAMPLE_DB = "postgresql+psycopg://hub:secret@postgres:5432/hub"
SAMPLE_HOP_SECRET = "0123456789abcdef0123456789abcdef"


def docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(folder: Path) -> dict[str, Any]:
    [k] = docs(folder / "kustomization.yaml")
    return k


def base_object(kind: str, name: str) -> dict[str, Any]:
    for resource in kustomization(BASE)["resources"]:
        for doc in docs(BASE / resource):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"base has no {kind} {name}")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def only_container(obj: dict[str, Any]) -> dict[str, Any]:
    [container] = pod_spec(obj)["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def hub_get_paths() -> set[str]:
    """Every GET path of the app, as its OpenAPI schema lists them."""
    app = create_app(HubSettings())  # no I/O until its lifespan runs
    return {path for path, methods in app.openapi()["paths"].items() if "get" in methods}


def test_every_yaml_parses_into_named_objects() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        for doc in docs(path):
            assert isinstance(doc, dict), path
            if "kind" in doc and doc["kind"] != "Kustomization":
                assert doc.get("apiVersion") and doc["metadata"].get("name"), path
    json.loads(DASHBOARD.read_text())


def test_probes_and_scraping_point_at_routes_the_hub_serves() -> None:
    deployment = base_object("Deployment", "hub")
    container = only_container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    serving_port = int(flag(container["command"], "--port"))
    assert ports == {"http": serving_port}
    paths = hub_get_paths()
    kinds = ("startupProbe", "livenessProbe", "readinessProbe")
    probes = {kind: container[kind]["httpGet"] for kind in kinds}
    for name, get in probes.items():
        assert get["path"] in paths, f"{name} probes {get['path']}, which the hub does not serve"
        assert ports.get(get["port"], get["port"]) == serving_port, name
    assert probes["readinessProbe"]["path"] == "/health/ready"
    assert probes["livenessProbe"]["path"] == "/health/live"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in paths
    assert int(annotations["prometheus.io/port"]) == serving_port
    service = base_object("Service", "hub")
    assert service["spec"]["ports"][0]["targetPort"] in ports


def secret_file(container: dict[str, Any], pod: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in `container`: a Secret volume's mount."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder) and "secret" in volumes[mount["name"]]:
            return volumes[mount["name"]]["secret"]["secretName"], path[len(folder) :]
    raise AssertionError(f"{path} is not in a mounted Secret")


def test_the_configmap_settings_with_the_pod_environment_are_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    generated = {g["name"]: g for g in kustomization(BASE)["configMapGenerator"]}
    [config_file] = generated["hub-config"]["files"]
    deployment = base_object("Deployment", "hub")
    container = only_container(deployment)
    for name, entry in env_of(container).items():
        if not name.startswith("HUB_"):
            continue
        value = SAMPLE_DB if name == "HUB_DATABASE_URL" else entry["value"]
        value = re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], value)
        if name == "HUB_REPLICA__HOP_SECRET_FILE":  # what the mounted Secret holds
            secret_file(container, pod_spec(deployment), value)
            value = str(tmp_path / "hop-secret")
            (tmp_path / "hop-secret").write_text(SAMPLE_HOP_SECRET)
        monkeypatch.setenv(name, value)

    settings = load_settings(BASE / config_file)

    assert settings.database_url == SAMPLE_DB  # the Secret's, not a default
    # Placement is on, and the replicas sign what they forward with the Secret's key.
    assert settings.replica.placement and settings.replica.hop_secret is not None
    assert settings.replica.hop_secret.get_secret_value() == SAMPLE_HOP_SECRET
    assert settings.replica.advertise_url == "http://10.0.0.7:8000"
    assert settings.replica.id == SAMPLE_ENV["POD_NAME"]
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert settings.port == int(flag(container["command"], "--port"))
    assert settings.replica.expire_after > settings.replica.heartbeat_interval
    # The config mount holds the file the command names.
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert flag(container["command"], "--config") == f"{mount['mountPath']}/{config_file}"
    # Kubernetes waits for the drain: preStop sleep + drain_timeout fit in the grace period.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert int(pre_stop[-1]) + settings.replica.drain_timeout < grace
    # The MLflow host in the settings is one of the ExternalName Services.
    externals = {d["metadata"]["name"] for d in docs(BASE / "external-services.yaml")}
    assert settings.mlflow_tracking_uri.split("//")[1].split(":")[0] in externals
    # CPU encoders' forward workers map the weights from /dev/shm: a memory-backed volume
    # there, as large as the CPU device's budget (a container's own is 64 MiB).
    [shm] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod_spec(deployment)["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    [cpu] = [d for d in settings.devices if d.name == "cpu"]
    assert parse_bytes(volume["emptyDir"]["sizeLimit"]) >= cpu.memory_budget


def test_the_migration_job_shares_image_config_and_database_with_the_deployment() -> None:
    deployment, job = base_object("Deployment", "hub"), base_object("Job", "hub-migrate")
    server, migrate = only_container(deployment), only_container(job)
    assert migrate["image"] == server["image"]
    assert migrate["command"][:3] == ["hub", "db", "upgrade"]
    assert flag(migrate["command"], "--config") == flag(server["command"], "--config")

    def config_volume(obj: dict[str, Any]) -> dict[str, Any]:
        [volume] = [v for v in pod_spec(obj)["volumes"] if "configMap" in v]
        return volume

    assert config_volume(job)["configMap"] == config_volume(deployment)["configMap"]
    db = env_of(server)["HUB_DATABASE_URL"]["valueFrom"]
    assert env_of(migrate)["HUB_DATABASE_URL"]["valueFrom"] == db


def test_the_overlay_secrets_hold_the_keys_the_deployment_reads() -> None:
    deployment = base_object("Deployment", "hub")
    container = only_container(deployment)
    ref = env_of(container)["HUB_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    hop_file = env_of(container)["HUB_REPLICA__HOP_SECRET_FILE"]["value"]
    secrets = {s["name"]: s for s in kustomization(OVERLAY)["secretGenerator"]}
    for name, key in [(ref["name"], ref["key"]),
                      secret_file(container, pod_spec(deployment), hop_file)]:  # fmt: skip
        keys = {literal.split("=", 1)[0] for literal in secrets[name]["literals"]}
        assert key in keys, (name, key)


def test_the_grafana_dashboard_queries_series_the_hub_exports_per_pod() -> None:
    source = "\n".join(p.read_text() for d in ("hub", "backends") for p in (REPO / d).rglob("*.py"))

    def base_name(series: str) -> str:
        return re.sub(r"_(total|bucket|sum|count)$", "", series)

    exported = {base_name(n) for n in re.findall(r'"(hub_[a-z0-9_]+)"', source)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        for series in re.findall(r"\bhub_[a-z0-9_]+", expr):
            assert base_name(series) in exported, f"{series} is not a series of the hub"
        if "hub_replicas_live" not in expr:
            assert 'pod=~"$pod"' in expr, f"not broken down by replica (pod): {expr}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed; the files were parsed only")
def test_the_example_overlay_renders_with_every_reference_resolved(tmp_path: Path) -> None:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    for kind in ("Deployment", "Service", "Job", "HorizontalPodAutoscaler",
                 "PodDisruptionBudget", "ConfigMap", "Secret", "Namespace"):  # fmt: skip
        assert kind in by_kind, f"the overlay renders no {kind}"
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "model-hub", obj["metadata"]["name"]

    [deployment], [job] = by_kind["Deployment"], by_kind["Job"]
    [config_map] = by_kind["ConfigMap"]
    secrets = {s["metadata"]["name"]: s for s in by_kind["Secret"]}
    server, migrate = only_container(deployment), only_container(job)
    assert server["image"] == migrate["image"] == "registry.example.com/ml/model-hub:0.1.0"
    for obj in (deployment, job):
        names = {v["configMap"]["name"] for v in pod_spec(obj)["volumes"] if "configMap" in v}
        assert names == {config_map["metadata"]["name"]}  # the generated, hashed name
        ref = env_of(only_container(obj))["HUB_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secrets[ref["name"]]["data"]  # the generated, hashed name
    hop_file = env_of(server)["HUB_REPLICA__HOP_SECRET_FILE"]["value"]
    name, key = secret_file(server, pod_spec(deployment), hop_file)
    assert key in secrets[name]["data"]

    (tmp_path / "hub.yaml").write_text(config_map["data"]["hub.yaml"])
    assert load_settings(tmp_path / "hub.yaml").mlflow_tracking_uri == "http://mlflow:5000"

    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    [hpa], [pdb] = by_kind["HorizontalPodAutoscaler"], by_kind["PodDisruptionBudget"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "hub_queue_depth"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    assert services["hub"]["spec"]["selector"].items() <= pod_labels.items()
    externals = {n: s["spec"]["externalName"] for n, s in services.items()
                 if s["spec"].get("type") == "ExternalName"}  # fmt: skip
    assert set(externals) == {"postgres", "mlflow", "object-store"}
    assert not any(host.endswith("example.internal") for host in externals.values())
