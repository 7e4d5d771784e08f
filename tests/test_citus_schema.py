"""The schema distributed on Citus, both ways a user has: `alembic -x distribute=true upgrade
head` (on a cluster of this module's own, with an application table to co-locate with), and
`idempotency-asgi migrate --distribute` (the session's cluster was made with it: running it
again changes nothing). Against a PostgreSQL without Citus it says so, and distributes
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.citus_cluster import running_cluster, skip_unless_available
from tests.server import ROOT

pytestmark = pytest.mark.citus

_GROUPS = """
SELECT logicalrelid::text || '=' || partmethod::text || ':' || colocationid
FROM pg_dist_partition ORDER BY 1
"""


def run(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DATABASE_URL": url},
    )


def groups(cluster: Any) -> dict[str, tuple[str, int]]:
    """Each distributed table: its method (h: hash, n: reference) and co-location group."""
    found = {}
    for line in cluster.psql(0, _GROUPS).splitlines():
        table, rest = line.split("=")
        method, group = rest.split(":")
        found[table] = (method, int(group))
    return found


@pytest.fixture(scope="module")
def bare_cluster() -> Iterator[Any]:
    skip_unless_available()
    with running_cluster() as cluster:
        yield cluster


def test_alembic_distributes_the_schema_with_the_applications_tables(bare_cluster):
    cluster = bare_cluster
    # The application's table came first, distributed by its own tenant column.
    cluster.psql(
        0,
        "CREATE TABLE orders (tenant_id text NOT NULL, id bigint NOT NULL,"
        " PRIMARY KEY (tenant_id, id));"
        " SELECT create_distributed_table('orders', 'tenant_id', shard_count => 4);",
    )
    upgrade = ("alembic", "-x", "distribute=true", "-x", "colocate_with=orders", "upgrade", "head")
    done = run(*upgrade, url=cluster.coordinator)
    assert done.returncode == 0, done.stderr
    found = groups(cluster)
    orders = found["orders"][1]
    assert found["idempotency_keys"] == ("h", orders)
    assert found["idempotency_leases"] == ("h", orders)
    assert found["idempotency_processed_messages"][0] == "h"
    assert found["idempotency_processed_messages"][1] != orders
    assert found["idempotency_asgi_version"][0] == "n"  # a reference table: on every node
    # Each worker holds shards of the key table, next to the application's
    placements = cluster.psql(
        0,
        "SELECT count(DISTINCT nodeport) FROM citus_shards"
        " WHERE table_name = 'idempotency_keys'::regclass",
    )
    assert placements == "2"
    # Again: nothing to do, nothing changed.
    again = run(*upgrade, url=cluster.coordinator)
    assert again.returncode == 0, again.stderr
    assert groups(cluster) == found
    # And the CLI agrees there is nothing left to distribute.
    cli = run("idempotency_asgi", "migrate", "--distribute", url=cluster.coordinator)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == ["schema already up to date", "already distributed"]
    # A store opened there knows it: its reaper runs (the one-server REAP, FOR UPDATE over
    # every shard, would be refused).
    reap = run("idempotency_asgi", "reap", "--once", url=cluster.coordinator)
    assert (reap.returncode, reap.stdout.strip()) == (0, "reaped 0"), reap.stderr


def test_migrate_distribute_again_on_the_sessions_cluster_changes_nothing(citus):
    before = groups(citus)
    assert {"idempotency_keys", "idempotency_leases", "effects"} <= before.keys()
    assert before["idempotency_keys"][1] == before["effects"][1]  # co-located
    again = run("idempotency_asgi", "migrate", "--distribute", url=citus.coordinator)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == ["schema already up to date", "already distributed"]
    assert groups(citus) == before


def test_without_citus_it_says_so_and_distributes_nothing(schema):
    done = run("idempotency_asgi", "migrate", "--distribute", url=schema)
    assert done.returncode == 1
    assert "no Citus extension" in done.stderr and "Traceback" not in done.stderr
    usage = run("idempotency_asgi", "migrate", "--colocate-with", "orders", url=schema)
    assert usage.returncode == 2 and "--colocate-with needs --distribute" in usage.stderr
