"""A throwaway PostgreSQL server for tests (and benchmarks), from the machine's own binaries.

    pytest_plugins = ["shared.testing.postgres"]   # or import the fixtures into a test module

- `postgres_url`: one server per test session (initdb + pg_ctl on a temp dir and a free
  port, trust auth on 127.0.0.1 only), a database in it, its URL; stopped (pg_ctl stop -m
  fast) and removed at the end. Skips, saying why, where the binaries or psycopg are absent.
- `postgres_schema_url`: per test, a fresh schema in that database and a URL whose
  search_path is it, so tests share the server without seeing each other's tables.

PostgreSQL refuses to run as root; as root the server runs as the `postgres` user (runuser),
in a directory under the system temp dir that it owns (pytest's own temp dirs are 0700 root).

`PostgresServer(host=...)` runs one on a test host (shared/testing/hosts.py), listening on
that host's address only: the database machine of a cluster split over hosts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest

if TYPE_CHECKING:
    from shared.testing.hosts import Host

SERVER_USER = "postgres"
DATABASE = "kvfabric_test"


class PostgresUnavailable(RuntimeError):
    """This machine cannot run one: the message says what is missing (tests skip)."""


class PostgresError(RuntimeError):
    """initdb, pg_ctl or the first connection failed (tests fail: something is broken)."""


def find_bin_dir() -> Path:
    """The directory of initdb and pg_ctl: PATH, else the newest /usr/lib/postgresql/*/bin."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    versions = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")]
    versions = [d for d in versions if d.parent.name.isdigit() and (d / "initdb").is_file()]
    if not versions:
        raise PostgresUnavailable(
            "PostgreSQL binaries (initdb, pg_ctl) not on PATH nor under /usr/lib/postgresql"
        )
    return max(versions, key=lambda d: int(d.parent.name))


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """`server.start()`, `server.url`, `server.stop()` (safe to call twice)."""

    def __init__(
        self, *, fsync: bool = False, port: int | None = None, host: Host | None = None
    ) -> None:
        self.bin_dir = find_bin_dir()
        self.fsync = fsync  # off for tests (nothing to keep); on for honest benchmark figures
        self.host = host
        self.address = host.address if host is not None else "127.0.0.1"
        if port is None:
            with host.inside() if host is not None else contextlib.nullcontext():
                port = free_port(self.address)
        self.port = port
        self.as_root = os.geteuid() == 0
        self.root_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql://{SERVER_USER}@{self.address}:{self.port}/{DATABASE}"

    def _run(self, *args: str, timeout_s: float = 60.0) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        if self.host is not None:
            command = self.host.command(command)
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
        if done.returncode != 0:
            raise PostgresError(f"{args[0]} failed ({done.returncode}): {done.stderr[-800:]}")

    def start(self) -> PostgresServer:
        if self.as_root:
            try:
                user = pwd.getpwnam(SERVER_USER)
            except KeyError as exc:
                raise PostgresUnavailable(f"running as root and no {SERVER_USER!r} user") from exc
        self.root_dir = Path(tempfile.mkdtemp(prefix="kvf-postgres-"))
        try:
            if self.as_root:
                os.chown(self.root_dir, user.pw_uid, user.pw_gid)
            self._start(self.root_dir)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, root: Path) -> None:
        data, log = root / "data", root / "server.log"
        self._run(
            "initdb",
            "-D",
            str(data),
            "-A",
            "trust",
            "-U",
            SERVER_USER,
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        if self.host is not None:  # the other hosts on its bridge, the cluster's clients
            with (data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all samenet trust\n")
        options = (
            f"-c listen_addresses={self.address} -p {self.port} -k {root} "
            f"-c fsync={'on' if self.fsync else 'off'}"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(data),
            "-l",
            str(log),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
            timeout_s=90.0,
        )
        import psycopg

        admin = f"postgresql://{SERVER_USER}@{self.address}:{self.port}/postgres"
        try:
            with (
                self.host.inside() if self.host is not None else contextlib.nullcontext(),
                psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn,
            ):
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
        except psycopg.Error as exc:
            raise PostgresError(f"creating the database failed: {exc}") from exc

    def stop(self) -> None:
        root, self.root_dir = self.root_dir, None
        if root is None:
            return
        try:
            if (root / "data" / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(root / "data"), "stop", "-m", "fast", "-w")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def schema_url(url: str, schema: str) -> str:
    """`url` with `schema` first on the search_path (libpq `options`)."""
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options={quote(f'-csearch_path={schema}')}"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed")
    try:
        server = PostgresServer()
    except PostgresUnavailable as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        server.start()
    except PostgresUnavailable as exc:  # root without a postgres user
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def postgres_schema_url(postgres_url: str) -> str:
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return schema_url(postgres_url, schema)
