"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine runs here): every
image pinned, services wired to each other by name, health checks gating start order, and the
hub's compose config holding the keys the hub reads."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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
    assert len(bases) == 2, "a build stage and the runtime stage"
    for base in bases:
        assert base.startswith("python:3.11.") and "slim" in base
        assert_pinned(base, "Dockerfile")

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


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]]  # (INSTRUCTION, its arguments, continuations joined)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def dockerfile_stages(text: str) -> list[Stage]:
    """The Dockerfile's stages, each with its instructions (comments dropped, `\\`
    continuations joined), as `docker build` reads them."""
    logical, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name, []))
        elif stages:
            stages[-1].instructions.append((instruction.upper(), args.strip()))
    return stages


COMPILERS = ("gcc", "clang", "build-essential", "g++")


def test_the_image_builds_the_kernels_in_its_build_stage_and_ships_them() -> None:
    """The kernels are compiled where a compiler is (the build stage), checked there, and
    reach the runtime stage with the installed package; the runtime stage installs no
    compiler, so a missing kernel cannot be hidden by a compile at first use."""
    build, runtime = dockerfile_stages(DOCKERFILE.read_text())
    assert build.name and runtime.base.startswith("python:3.11.")
    build_runs = build.args("RUN")
    installs_compiler = [r for r in build_runs if "apt-get install" in r]
    assert installs_compiler and any(c in installs_compiler[0].split() for c in COMPILERS)
    # The venv the package is installed into, and then the install (setup.py's build step
    # compiles the kernels into it) followed by the check that every variant is there.
    assert any(a.startswith("VIRTUAL_ENV=/opt/venv") or " VIRTUAL_ENV=/opt/venv" in a
               for a in build.args("ENV"))  # fmt: skip
    assert any("python -m venv /opt/venv" in r for r in build_runs)
    copies = build.args("COPY")
    assert "setup.py README.md ./" in copies and "backends ./backends" in copies
    [install] = [r for r in build_runs if "-c constraints.txt '.[demo]'" in r]
    assert install.index("pip install") < install.index("native_build check")
    assert "python -P -m backends.llm.native_build check" in install  # the installed copy
    # The runtime stage: the built environment, no compiler, the hub on its PATH.
    for run in runtime.args("RUN"):
        assert not any(c in run.split() for c in COMPILERS), run
    assert f"--from={build.name} /opt/venv /opt/venv" in runtime.args("COPY")
    assert any("PATH=/opt/venv/bin:$PATH" in a for a in runtime.args("ENV"))
    assert runtime.args("CMD") and runtime.args("CMD")[0].startswith('["hub", "serve"')


def test_the_kernel_check_fails_without_the_built_libraries(tmp_path: Path) -> None:
    """What the build stage's `native_build check` does on an install that built nothing."""
    from backends.llm import native_build

    assert native_build.main(["check", "--dir", str(tmp_path)]) == 1
    assert native_build.missing(tmp_path, openmp=False)


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
