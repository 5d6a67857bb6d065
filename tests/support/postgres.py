"""A throwaway PostgreSQL cluster for tests: initdb into a temp folder, start on a free
loopback port, drop it all afterwards. Skips (with the reason) where it cannot run."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb refuses to run as root; run the server binaries as the `postgres` user then."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("running as root and `runuser` is missing, cannot start PostgreSQL")
    return [runuser, "-u", "postgres", "--", *cmd]


@contextlib.contextmanager
def throwaway_postgres(dbnames: tuple[str, ...] = ("hub",)) -> Iterator[dict[str, str]]:
    """Yield {dbname: SQLAlchemy URL} for a fresh cluster; everything is deleted afterwards."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="hub-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        try:
            shutil.chown(root, "postgres")
            shutil.chown(sock, "postgres")
        except (LookupError, PermissionError) as e:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(f"running as root without a usable `postgres` user: {e}")
    port = free_port()
    env = {**os.environ, "LC_ALL": "C"}
    try:
        subprocess.run(
            _as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                          "--auth=trust", "-E", "UTF8"]),
            check=True, capture_output=True, env=env, timeout=120,
        )  # fmt: skip
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l",
                          str(root / "log"), "-o",
                          f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off",
                          "start"]),
            check=True, capture_output=True, env=env, timeout=120,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        out = getattr(e, "stderr", b"") or b""
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(
            f"could not start a throwaway PostgreSQL: {out.decode(errors='replace')[-300:]}"
        )
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
        yield {name: f"postgresql+psycopg://postgres@127.0.0.1:{port}/{name}" for name in dbnames}
    finally:
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True, env=env, timeout=60,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
