"""A throwaway PostgreSQL cluster for benchmarks and tests: initdb into a temp folder, start on
a free loopback port, drop it all afterwards. Where it cannot run, `PostgresUnavailable` says
why (tests/support/postgres.py turns that into a skip)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.launch.process import free_port

PG_BIN_DIRS = [
    Path("/usr/lib/postgresql/15/bin"),
    *sorted(Path("/usr/lib/postgresql").glob("*/bin")),
]


def _pg_bin() -> Path | None:
    for d in PG_BIN_DIRS:
        if (d / "initdb").is_file() and (d / "pg_ctl").is_file():
            return d
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class PostgresUnavailable(RuntimeError):
    """No throwaway PostgreSQL can run here (no server binaries, no `postgres` user, initdb
    failed); the message says which."""


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb refuses to run as root; run the server binaries as the `postgres` user then."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser is None:
        raise PostgresUnavailable(
            "running as root and `runuser` is missing, cannot start PostgreSQL"
        )
    return [runuser, "-u", "postgres", "--", *cmd]


@dataclass
class PostgresServer:
    """A throwaway cluster that can be stopped (`-m immediate`: a crash, no goodbye) and
    started again on the same port and data: a database outage, then recovery."""

    bin_dir: Path
    root: Path
    port: int
    urls: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "LC_ALL": "C"}

    def start(self) -> None:
        sock, data = self.root / "sock", self.root / "data"
        subprocess.run(
            _as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l",
                          str(self.root / "log"), "-o",
                          f"-p {self.port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off",
                          "start"]),
            check=True, capture_output=True, env=self.env, timeout=120,
        )  # fmt: skip

    def stop(self) -> None:
        subprocess.run(
            _as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), "-m",
                          "immediate", "stop"]),
            capture_output=True, env=self.env, timeout=60,
        )  # fmt: skip


@contextlib.contextmanager
def throwaway_postgres(dbnames: tuple[str, ...] = ("hub",)) -> Iterator[dict[str, str]]:
    """Yield {dbname: SQLAlchemy URL} for a fresh cluster; everything is deleted afterwards."""
    with postgres_server(dbnames) as server:
        yield server.urls


@contextlib.contextmanager
def postgres_server(dbnames: tuple[str, ...] = ("hub",)) -> Iterator[PostgresServer]:
    """A fresh cluster with `dbnames` created (`urls`: {dbname: SQLAlchemy URL}), which the
    test may stop and start; everything is deleted afterwards."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        raise PostgresUnavailable("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="hub-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        try:
            shutil.chown(root, "postgres")
            shutil.chown(sock, "postgres")
        except (LookupError, PermissionError) as e:
            shutil.rmtree(root, ignore_errors=True)
            raise PostgresUnavailable(
                f"running as root without a usable `postgres` user: {e}"
            ) from e
    server = PostgresServer(bin_dir, root, free_port())
    try:
        subprocess.run(
            _as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                          "--auth=trust", "-E", "UTF8"]),
            check=True, capture_output=True, env=server.env, timeout=120,
        )  # fmt: skip
        server.start()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        out = getattr(e, "stderr", b"") or b""
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(
            f"could not start a throwaway PostgreSQL: {out.decode(errors='replace')[-300:]}"
        ) from e
    port = server.port
    try:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(
                    host="127.0.0.1", port=port, user="postgres", dbname="postgres",
                    autocommit=True,
                ) as conn:  # fmt: skip
                    for name in dbnames:
                        conn.execute(f'CREATE DATABASE "{name}"')
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        server.urls.update(
            {name: f"postgresql+psycopg://postgres@127.0.0.1:{port}/{name}" for name in dbnames}
        )
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
