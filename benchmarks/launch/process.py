"""Running `hub serve` (and an MLflow server) as a real process on a loopback port, as a user
would; `hub_config` writes the config file a local benchmark hub starts from."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hub_config(root: Path, models: Sequence[Mapping[str, Any]] = (), **settings: Any) -> Path:
    """Write `root/hub.yaml` for a hub of its own under `root` (SQLite registry and MLflow, a
    4 GiB CPU budget, a 1 GiB host cache, warnings only in the log) that registers `models`;
    `settings` add or replace top-level keys. Returns the file's path."""
    config = {
        "database_url": f"sqlite:///{root / 'hub.db'}",
        "mlflow_tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
        "cache_dir": str(root / "cache"),
        "demo_dir": str(root / "demo"),
        "devices": [{"name": "cpu", "memory_budget": "4GiB"}],
        "host_cache_budget": "1GiB",
        "log_level": "warning",
        "models": [dict(m) for m in models],
        **settings,
    }
    path = root / "hub.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _spawn(
    config: Path, cwd: Path, port: int, env: dict[str, str] | None
) -> tuple[subprocess.Popen[str], TextIO]:
    full_env = {
        **os.environ,
        "HUB_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        # This checkout's code, whatever is installed and wherever the hub starts.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    log = (cwd / f"hub-{port}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hub.cli", "serve", "--config", str(config)],
        cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return proc, log


def _wait_ready(base: str, proc: subprocess.Popen[str], log: TextIO, deadline: float) -> None:
    timeout = deadline - time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"hub exited with {proc.returncode}:\n{read_log(log.name)}")
        try:
            if httpx.get(f"{base}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"hub not ready after {timeout:.0f}s:\n{read_log(log.name)}")
        time.sleep(0.3)


def _interrupt(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # once: a second SIGINT makes uvicorn force its exit


def _reap(proc: subprocess.Popen[str], log: TextIO) -> None:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@contextlib.contextmanager
def hub_process(
    config: Path,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Start `hub serve --config CONFIG` in CWD on `port` (default: a free one); yield
    (base URL, process)."""
    port = port or free_port()
    proc, log = _spawn(config, cwd, port, env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, log, time.monotonic() + timeout)
        yield base, proc
    finally:
        _interrupt(proc)
        _reap(proc, log)


@contextlib.contextmanager
def hub_processes(
    config: Path, cwds: list[Path], timeout: float = 180
) -> Iterator[list[tuple[str, subprocess.Popen[str]]]]:
    """Start one `hub serve --config CONFIG` per folder of `cwds` at the same instant, each
    on a free port; yield [(base URL, process)] once every one is ready. Each is stopped with
    SIGINT (a clean shutdown) at the end, unless it is gone already. They share a fresh
    `replica.hop_secret` (HUB_REPLICA__HOP_SECRET), as replicas must to place requests."""
    started = []
    env = {"HUB_REPLICA__HOP_SECRET": secrets.token_hex(32)}
    try:
        for cwd in cwds:
            port = free_port()
            started.append((f"http://127.0.0.1:{port}", *_spawn(config, cwd, port, env)))
        deadline = time.monotonic() + timeout
        for base, proc, log in started:
            _wait_ready(base, proc, log, deadline)
        yield [(base, proc) for base, proc, _ in started]
    finally:
        for _, proc, _ in started:
            _interrupt(proc)
        for _, proc, log in started:
            _reap(proc, log)


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, root: Path, timeout: float = 180) -> Iterator[str]:
    """An `mlflow server` on loopback (artifacts served from `root`); yields its URL. Webhooks
    may call loopback addresses, as the hub's tests need."""
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        # MLflow's job runner (half a dozen huey consumer processes) serves nothing the hub
        # uses; without it the server starts in a fraction of the time.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    log = (root / "mlflow-server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
         "--artifacts-destination", (root / "mlflow-artifacts").as_uri(), "--serve-artifacts",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited:\n{read_log(log.name)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow server not up after {timeout}s:\n{read_log(log.name)}")
            time.sleep(0.5)
        yield url
    finally:
        # The server forks workers: end the whole process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def read_log(path: str) -> str:
    return Path(path).read_text()[-4000:]
