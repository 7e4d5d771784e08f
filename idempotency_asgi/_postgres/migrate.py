"""Apply the schema without Alembic: `idempotency-asgi migrate` or `await migrate(dsn)`."""

from __future__ import annotations

from typing import Any

import asyncpg

from .schema import HEAD, MIGRATION_LOCK_ID, REVISIONS, VERSION_TABLE
from .urls import asyncpg_url


async def migrate(dsn: str) -> list[str]:
    """Bring the schema up to head; return the revisions applied (empty when up to date).

    Safe to run from several processes at once: the whole upgrade is one transaction holding
    an advisory lock, so the second runner waits and then finds nothing to do. `dsn` is any
    URL the store takes (`postgresql+asyncpg://` too); one it cannot use raises ValueError.
    """
    conn = await asyncpg.connect(asyncpg_url(dsn))
    try:
        return await migrate_connection(conn)
    finally:
        await conn.close()


async def migrate_connection(conn: Any) -> list[str]:
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_ID)
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} ("
            " version_num varchar(32) NOT NULL,"
            f" CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
        )
        current = await conn.fetchval(f"SELECT version_num FROM {VERSION_TABLE}")
        ids = [revision.id for revision in REVISIONS]
        if current is not None and current not in ids:
            raise RuntimeError(
                f"the database is at schema revision {current!r}, which this version of "
                "idempotency-asgi does not know; upgrade the package"
            )
        start = 0 if current is None else ids.index(current) + 1
        for revision in REVISIONS[start:]:
            for statement in revision.upgrade:
                await conn.execute(statement)
            applied.append(revision.id)
        if applied:
            await conn.execute(f"DELETE FROM {VERSION_TABLE}")
            await conn.execute(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ($1)", HEAD)
    return applied
