"""Alembic environment: DATABASE_URL (postgresql://..., or SQLAlchemy's postgresql+asyncpg://),
asyncpg through SQLAlchemy.

On a Citus cluster (against the coordinator), `alembic -x distribute=true upgrade head`
distributes the tables by tenant once they are there, as `idempotency-asgi migrate
--distribute` does; `-x colocate_with=TABLE` names an application table to co-locate them
with (see idempotency_asgi/_postgres/distribute.py).
"""

from __future__ import annotations

import asyncio
import os
from functools import partial

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from idempotency_asgi._postgres import distribute as _distribute
from idempotency_asgi._postgres import sql as _sql
from idempotency_asgi._postgres.schema import MIGRATION_LOCK_ID, VERSION_TABLE
from idempotency_asgi._postgres.urls import asyncpg_url


def _database_url() -> str:
    """The database's URL as asyncpg reads it: the URLs the store takes, and no other."""
    url = os.environ.get("DATABASE_URL") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set DATABASE_URL to the database to migrate (postgresql://...)")
    try:
        return asyncpg_url(url)
    except ValueError as exc:
        raise SystemExit(f"DATABASE_URL: {exc}") from None


def _upgrade(connection: Connection) -> None:
    # The same version table and lock as `idempotency-asgi migrate`, so the two never race
    # and either can continue where the other stopped.
    context.configure(connection=connection, version_table=VERSION_TABLE)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


def _distribute_tables(connection: Connection) -> None:
    options = context.get_x_argument(as_dictionary=True)
    if options.get("distribute", "").lower() not in ("1", "true", "yes"):
        return
    if not connection.execute(text(_sql.HAS_CITUS)).scalar():
        raise SystemExit("-x distribute=true: this database has no Citus extension")
    for statement in _distribute.statements(options.get("colocate_with")):
        connection.execute(text(statement))


async def _run() -> None:
    # asyncpg reads the URL itself (as the store does): SQLAlchemy's reading of its query
    # differs (`sslmode`), and a connection made for it needs none.
    engine = create_async_engine(
        "postgresql+asyncpg://", async_creator=partial(asyncpg.connect, _database_url())
    )
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_upgrade)
            await connection.commit()
            # After the revisions' transaction: Citus distributes tables that exist.
            await connection.run_sync(_distribute_tables)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported; run against a database")
asyncio.run(_run())
