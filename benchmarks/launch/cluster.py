"""A hub cluster on loopback, as Kubernetes would run it: one throwaway PostgreSQL, one MLflow
server and N `hub serve` replicas sharing them, each replica in its own folder (its own local
cache, as a pod's) on its own port.

Multi-process topologies are expensive to start (tens of seconds on two cores), so tests share
one `Cluster` (see tests/hub/replicas/conftest.py) and leave it as they found it: a test that
kills a replica or MLflow starts it again before it ends (`Replica.restart`, `MlflowServer.start`).

The replicas share a `replica.hop_secret` (a fresh one per cluster unless the config names
one), as a Kubernetes deployment's do: without it they would not place requests.
`Replica.post_here` sends a request signed as a peer's forward, served where it lands.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import yaml
from sqlalchemy import Engine, create_engine

from benchmarks.launch.postgres import throwaway_postgres
from benchmarks.launch.process import REPO, free_port, read_log
from hub.placement.forwarding import HopSigner, hop_headers


def wait_for(condition: Callable[[], bool], what: str, within: float = 60) -> None:
    """Poll `condition` every 0.1 s until it holds; fail with `what` after `within` seconds.
    The bound is a hang guard, not a performance claim: keep it generous."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@dataclass
class MlflowServer:
    """`mlflow server` on a fixed loopback port, so it can be killed and started again at the
    same URL (an outage, then recovery)."""

    backend_store_uri: str
    root: Path
    port: int = field(default_factory=free_port)
    _proc: subprocess.Popen[bytes] | None = None
    _log: TextIO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 180) -> None:
        env = {
            **os.environ,
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
            "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        self._log = (self.root / "mlflow-server.log").open("a")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             self.backend_store_uri, "--artifacts-destination",
             (self.root / "mlflow-artifacts").as_uri(), "--serve-artifacts",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited:\n{read_log(self._log.name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow server not up after {timeout}s")
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL the whole server (it forks workers): an outage, no goodbye."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=30)
        self._proc = None
        if self._log is not None:
            self._log.close()


@dataclass
class Replica:
    """One `hub serve` process of the cluster, in its own folder, on a fixed port."""

    index: int
    config: Path
    folder: Path
    port: int = field(default_factory=free_port)
    env: Mapping[str, str] = field(default_factory=dict)
    hop_secret: str | None = None
    proc: subprocess.Popen[str] | None = None
    _log: TextIO | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / f"hub-{self.port}.log"

    def spawn(self) -> None:
        env = {
            **os.environ,
            "HUB_PORT": str(self.port),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **self.env,
        }
        self._log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hub.cli", "serve", "--config", str(self.config)],
            cwd=self.folder, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"replica {self.index} exited with {self.proc.returncode}:\n"
                    f"{read_log(str(self.log_path))}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/health/ready", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.index} not ready:\n{read_log(str(self.log_path))}"
                )
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; its heartbeat row stays until it expires."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGINT once (a second makes uvicorn force its exit), then wait for the drain."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()

    def restart(self, timeout: float = 180) -> None:
        """Start again on the same port and folder (a pod restarted with its volume)."""
        self.stop()
        self.spawn()
        self.wait_ready(time.monotonic() + timeout)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", timeout=kwargs.pop("timeout", 30), **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", timeout=kwargs.pop("timeout", 60), **kwargs)

    def post_here(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None, timeout: float = 60
    ) -> httpx.Response:
        """POST `body` as JSON with the hop headers a forwarding peer signs: this replica
        serves it itself, whatever placement would decide (no version named: it routes it)."""
        content = json.dumps(body).encode()
        hop = hop_headers(HopSigner(self.hop_secret), "POST", path, content, "test")
        headers = {"content-type": "application/json", **(headers or {}), **hop}
        return self.post(path, content=content, headers=headers, timeout=timeout)

    def put(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.put(f"{self.base}{path}", timeout=kwargs.pop("timeout", 60), **kwargs)

    def delete(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.delete(f"{self.base}{path}", timeout=kwargs.pop("timeout", 60), **kwargs)


@dataclass
class Cluster:
    """PostgreSQL URLs (`hub`, `mlflow` databases), the MLflow server, the replicas, and a
    SQLAlchemy engine on the hub's database for assertions."""

    urls: dict[str, str]
    mlflow: MlflowServer
    replicas: list[Replica]
    config: dict[str, Any]
    engine: Engine

    @property
    def bases(self) -> list[str]:
        return [r.base for r in self.replicas]


@contextlib.contextmanager
def running_cluster(
    root: Path,
    config: Mapping[str, Any],
    replicas: int = 3,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> Iterator[Cluster]:
    """Start PostgreSQL, MLflow, then `replicas` hubs at the same instant on the empty
    database, with `config` plus `database_url` and `mlflow_tracking_uri` filled in; yield once
    every replica is ready; stop everything at the end. The replicas share `replica.hop_secret`:
    the config's, else a fresh one."""
    with throwaway_postgres(("hub", "mlflow")) as urls:
        mlflow = MlflowServer(urls["mlflow"], root)
        mlflow.start()
        peers = dict(config.get("replica", {}))
        peers.setdefault("hop_secret", secrets.token_hex(32))
        full = {
            **config,
            "database_url": urls["hub"],
            "mlflow_tracking_uri": mlflow.url,
            "replica": peers,
        }
        config_path = root / "hub.yaml"
        config_path.write_text(yaml.safe_dump(full))
        members = []
        for i in range(replicas):
            folder = root / f"replica-{i}"
            folder.mkdir()
            members.append(Replica(i, config_path, folder, env=dict(env or {}),
                                   hop_secret=peers["hop_secret"]))  # fmt: skip
        engine = create_engine(urls["hub"])
        try:
            for replica in members:
                replica.spawn()
            deadline = time.monotonic() + timeout
            for replica in members:
                replica.wait_ready(deadline)
            yield Cluster(urls, mlflow, members, full, engine)
        finally:
            for replica in members:
                if replica.proc is not None and replica.proc.poll() is None:
                    replica.proc.send_signal(signal.SIGINT)
            for replica in members:
                replica.stop()
            mlflow.kill()
            engine.dispose()
