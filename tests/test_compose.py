"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine runs here): every
image pinned, services wired to each other by name, health checks gating start order, and the
hub's compose config holding the keys the hub reads."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
HUB_CONFIG = REPO_ROOT / "configs" / "compose.yaml"

# Services that run once and exit; every other service is long-running.
ONE_SHOT_SERVICES = {"minio-init"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def image_tag(reference: str) -> str | None:
    """The tag of an image reference (`@sha256:` digests count as a tag), None when absent."""
    if "@sha256:" in reference:
        return reference.split("@", 1)[1]
    name = reference.rsplit("/", 1)[-1]  # a registry host may carry a port: host:5000/img
    return name.split(":", 1)[1] if ":" in name else None


def assert_pinned(reference: str, where: str) -> None:
    tag = image_tag(reference)
    assert tag, f"{where}: image {reference!r} has no tag"
    assert tag != "latest", f"{where}: image {reference!r} uses latest"
    # A release, not a moving major-version tag such as `15` or `v3`.
    assert re.search(r"\d+\.\d+|RELEASE\.\d{4}-|sha256:", tag), f"{where}: {reference!r}"


def from_images(dockerfile_text: str) -> list[str]:
    return re.findall(r"^FROM\s+(?:--platform=\S+\s+)?(\S+)", dockerfile_text, re.MULTILINE)


def test_every_image_is_pinned_to_a_release(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "image" in service:
            assert_pinned(service["image"], name)
        build = service.get("build")
        if build is None:
            continue
        if "dockerfile_inline" in build:
            text = build["dockerfile_inline"]
        else:
            text = (REPO_ROOT / build.get("context", ".") / build["dockerfile"]).read_text()
        bases = from_images(text)
        assert bases, f"{name}: its Dockerfile has no FROM"
        for base in bases:
            assert_pinned(base, f"{name} (FROM)")
    assert ":latest" not in COMPOSE_FILE.read_text()


def test_hub_is_built_from_the_repository_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    hub = services["hub"]
    assert hub["build"]["context"] == "."
    assert hub["build"]["dockerfile"] == "Dockerfile"
    assert hub["command"] == [
        "hub",
        "serve",
        "--config",
        "/app/configs/compose.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    assert "./configs/compose.yaml:/app/configs/compose.yaml:ro" in hub["volumes"]
    # The forward workers map CPU weights from /dev/shm: room for the CPU device's budget.
    from backends.units import parse_bytes

    config = yaml.safe_load((REPO_ROOT / "configs" / "compose.yaml").read_text())
    [cpu] = [d for d in config["devices"] if d["name"] == "cpu"]
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", hub["shm_size"]).groups()  # type: ignore[union-attr]
    docker_bytes = int(number) * 1024 ** "_kmg".index(unit or "_")  # Docker's units are binary
    assert docker_bytes >= parse_bytes(cpu["memory_budget"])


def test_hub_reaches_postgres_and_mlflow_by_service_name(
    services: dict[str, dict[str, Any]],
) -> None:
    env = services["hub"]["environment"]
    assert env["HUB_DATABASE_URL"] == "postgresql+psycopg://hub:hub@postgres:5432/hub"
    assert env["HUB_MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    for variable in ("HUB_DATABASE_URL", "HUB_MLFLOW_TRACKING_URI"):
        assert urlsplit(env[variable]).hostname in services, variable
    assert urlsplit(env["MLFLOW_S3_ENDPOINT_URL"]).hostname == "minio"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]


def test_start_order_waits_on_health_and_the_bucket_job(
    services: dict[str, dict[str, Any]],
) -> None:
    hub_deps = services["hub"]["depends_on"]
    assert hub_deps["postgres"]["condition"] == "service_healthy"
    assert hub_deps["mlflow"]["condition"] == "service_healthy"
    assert hub_deps["minio-init"]["condition"] == "service_completed_successfully"
    mlflow_deps = services["mlflow"]["depends_on"]
    assert mlflow_deps["postgres"]["condition"] == "service_healthy"
    assert mlflow_deps["minio-init"]["condition"] == "service_completed_successfully"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"

    # A dependency can only be waited on for health if it has a health check.
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} -> {dependency}"


def test_every_long_running_service_has_a_healthcheck(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        if name in ONE_SHOT_SERVICES:
            assert service.get("restart") == "no", name
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
    hub_check = " ".join(services["hub"]["healthcheck"]["test"])
    assert "/health/ready" in hub_check
    assert "/health" in " ".join(services["mlflow"]["healthcheck"]["test"])
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


def test_ports_published_for_users(services: dict[str, dict[str, Any]]) -> None:
    def published(name: str) -> set[str]:
        return {str(port) for port in services[name].get("ports", [])}

    assert "8000:8000" in published("hub")
    assert "5000:5000" in published("mlflow")
    assert "9001:9001" in published("minio")  # the console


def test_mlflow_keeps_metadata_in_postgres_and_artifacts_in_minio(
    services: dict[str, dict[str, Any]],
) -> None:
    command = " ".join(services["mlflow"]["command"])
    store = re.search(r"--backend-store-uri[= ](\S+)", command)
    assert store, command
    assert urlsplit(store.group(1)).scheme.startswith("postgresql")
    assert urlsplit(store.group(1)).hostname == "postgres"
    assert urlsplit(store.group(1)).path == "/mlflow"
    assert "--artifacts-destination=s3://mlflow/" in command
    assert "--serve-artifacts" in command
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "local/mlflow" in " ".join(services["minio-init"]["command"])


def test_postgres_creates_both_databases(services: dict[str, dict[str, Any]]) -> None:
    postgres = services["postgres"]
    assert postgres["environment"]["POSTGRES_DB"] == "hub"
    init_mounts = [v for v in postgres["volumes"] if "/docker-entrypoint-initdb.d/" in v]
    assert init_mounts
    script = REPO_ROOT / init_mounts[0].split(":", 1)[0]
    assert re.search(r"CREATE DATABASE mlflow\b", script.read_text())


def test_volumes_are_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in named, f"{name} uses undeclared volume {source}"


def test_gpu_reservation_is_offered_commented_out(services: dict[str, Any]) -> None:
    assert "deploy" not in services["hub"]
    lines = [line.strip() for line in COMPOSE_FILE.read_text().splitlines()]
    commented = {line.lstrip("# ").strip() for line in lines if line.startswith("#")}
    for key in ("deploy:", "reservations:", "devices:", "- driver: nvidia", "capabilities: [gpu]"):
        assert key in commented, key


def test_dockerfile_is_pinned_non_root_and_layer_cached() -> None:
    text = DOCKERFILE.read_text()
    bases = from_images(text)
    assert len(bases) == 1 and bases[0].startswith("python:3.11.")
    assert_pinned(bases[0], "Dockerfile")
    assert "slim" in bases[0]

    lines = [line.strip() for line in text.splitlines()]
    copy_manifest = lines.index("COPY pyproject.toml constraints.txt ./")
    copy_source = lines.index("COPY hub ./hub")
    assert copy_manifest < copy_source  # dependencies are a layer of their own
    assert "pip install --no-cache-dir -c constraints.txt '.[demo]'" in text
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert "EXPOSE 8000" in lines
    assert any(line.startswith("HEALTHCHECK") for line in lines)
    assert "/health/ready" in text
    assert (
        'CMD ["hub", "serve", "--config", "/app/configs/compose.yaml", '
        '"--host", "0.0.0.0", "--port", "8000"]'
    ) in lines


def test_compose_config_has_the_hub_keys() -> None:
    config = yaml.safe_load(HUB_CONFIG.read_text())
    assert set(config) == {
        "database_url",
        "mlflow_tracking_uri",
        "cache_dir",
        "devices",
        "host_cache_budget",
        "auth",
        "models",
    }
    assert config["database_url"] == "postgresql+psycopg://hub:hub@postgres:5432/hub"
    assert config["mlflow_tracking_uri"] == "http://mlflow:5000"
    assert config["cache_dir"] == "/data/cache"
    assert config["devices"] == [{"name": "cpu", "memory_budget": "8GiB"}]
    assert config["host_cache_budget"] == "8GiB"
    assert config["auth"] == {"enabled": False}
    assert config["models"] == []


def test_compose_config_is_accepted_by_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    settings_module = pytest.importorskip("hub.settings")
    for variable in [v for v in os.environ if v.startswith("HUB_")]:
        monkeypatch.delenv(variable)
    settings = settings_module.load_settings(HUB_CONFIG)
    assert str(settings.cache_dir) == "/data/cache"
    assert [device.name for device in settings.devices] == ["cpu"]
