"""The schema on a Citus cluster: `idempotency-asgi migrate --distribute`, `alembic -x
distribute=true upgrade head`, or `await distribute(dsn)`, against the coordinator, once the
tables are there (see docs/scaling-out.md).

`idempotency_keys` and `idempotency_leases` are distributed by `tenant_id` in one
co-location group, with the application's tables when `colocate_with` names one of them
(already distributed by its tenant column, of type text); without it, Citus's default group
for text columns, which the application's tables join when they are distributed by a text
column with the default shard count. The consumer's dedup records have no tenant: they go by
`message_id`, in a group of their own. The schema's version table becomes a reference table
(a copy on every node), so that a store connected to any node can check the schema.

Each step is skipped when it was done already: running it again changes nothing. A table
that holds rows is distributed with them (Citus moves them to the shards), so a database
restored onto the coordinator from a single PostgreSQL is distributed in place.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from . import sql
from .schema import VERSION_TABLE
from .urls import asyncpg_url

#: The tables, their distribution column, and what they are co-located with (None: the
#: `colocate_with` given, or Citus's default group).
TABLES: tuple[tuple[str, str, str | None], ...] = (
    ("idempotency_keys", "tenant_id", None),
    ("idempotency_leases", "tenant_id", "idempotency_keys"),
    ("idempotency_processed_messages", "message_id", "none"),
)


def statements(colocate_with: str | None = None) -> list[str]:
    """The statements that distribute the schema (each one skipped when done), as SQL with
    no parameters: for asyncpg and for Alembic's `op.execute` alike."""
    found: list[str] = []
    for table, column, group in TABLES:
        name, with_group = _literal(table), _literal(group or colocate_with or "default")
        found.append(
            f"SELECT create_distributed_table({name}, {_literal(column)},"
            f" colocate_with => {with_group}) WHERE NOT EXISTS (SELECT 1 FROM"
            f" pg_dist_partition WHERE logicalrelid = to_regclass({name}))"
        )
    name = _literal(VERSION_TABLE)
    found.append(
        f"SELECT create_reference_table({name}) WHERE NOT EXISTS (SELECT 1 FROM"
        f" pg_dist_partition WHERE logicalrelid = to_regclass({name}))"
    )
    return found


def _literal(value: str) -> str:
    """A table or group name as an SQL string literal (names come from the operator's
    command line; quote them rather than trust them)."""
    return "'" + value.replace("'", "''") + "'"


class NotCitus(RuntimeError):
    """The database has no Citus extension: there is nothing to distribute over."""


async def distribute(dsn: str, *, colocate_with: str | None = None) -> list[str]:
    """Distribute the schema (see the module's docstring); the tables it distributed now
    (empty when all of them already were)."""
    conn = await asyncpg.connect(asyncpg_url(dsn))
    try:
        return await distribute_connection(conn, colocate_with=colocate_with)
    finally:
        await conn.close()


async def distribute_connection(conn: Any, *, colocate_with: str | None = None) -> list[str]:
    if not await conn.fetchval(sql.HAS_CITUS):
        raise NotCitus(
            "this database has no Citus extension (CREATE EXTENSION citus, on the"
            " coordinator of a Citus cluster): there is nothing to distribute the tables over"
        )
    before = await _distributed(conn)
    for statement in statements(colocate_with):
        await conn.execute(statement)
    after = await _distributed(conn)
    return [table for table, _, _ in TABLES if table in after - before]


async def _distributed(conn: Any) -> set[str]:
    rows = await conn.fetch(
        "SELECT logicalrelid::regclass::text AS name FROM pg_dist_partition WHERE partmethod = 'h'"
    )
    return {row["name"] for row in rows}
