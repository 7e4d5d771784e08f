"""The schema comes only from migrations: Alembic at the repository root, or the CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from idempotency_asgi import migrate
from idempotency_asgi._postgres.schema import HEAD, REVISIONS, VERSION_TABLE
from tests.helpers import fresh_database

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def fresh(schema):
    async with fresh_database(schema) as url:
        yield url


async def describe(dsn: str) -> tuple[str, list[str], list[str]]:
    conn = await asyncpg.connect(dsn)
    try:
        version = await conn.fetchval(f"SELECT version_num FROM {VERSION_TABLE}")
        columns = await conn.fetch(
            "SELECT table_name, column_name, data_type FROM information_schema.columns"
            " WHERE table_schema = current_schema()"
            " AND table_name IN ('idempotency_keys', 'idempotency_leases')"
            " ORDER BY table_name, ordinal_position"
        )
        indexes = await conn.fetch(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename IN ('idempotency_keys', 'idempotency_leases') ORDER BY indexname"
        )
    finally:
        await conn.close()
    return (
        version,
        [f"{c['table_name']}.{c['column_name']} {c['data_type']}" for c in columns],
        [i["indexdef"] for i in indexes],
    )


def run(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": dsn}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


async def test_alembic_and_the_cli_build_the_same_schema(schema, fresh):
    alembic = run(sys.executable, "-m", "alembic", "upgrade", "head", dsn=fresh)
    assert alembic.returncode == 0, alembic.stderr
    via_alembic = await describe(fresh)
    # The CLI sees Alembic's version row and has nothing to do...
    cli = run(sys.executable, "-m", "idempotency_asgi", "migrate", dsn=fresh)
    assert cli.returncode == 0, cli.stderr
    assert "up to date" in cli.stdout
    # ...and builds the very same schema on its own.
    assert via_alembic == await describe(schema)
    assert via_alembic[0] == HEAD
    assert "idempotency_keys.fingerprint bytea" in via_alembic[1]
    assert "idempotency_keys.response_body bytea" in via_alembic[1]
    assert "idempotency_leases.lease_expires_at timestamp with time zone" in via_alembic[1]
    # keys: primary key, reaper index, in-flight index; leases: primary key, sweeper index
    assert len(via_alembic[2]) == 5


async def test_concurrent_migrations_apply_each_revision_once(fresh):
    results = await asyncio.gather(*(migrate(fresh) for _ in range(6)))
    assert sorted(results) == [[]] * 5 + [[revision.id for revision in REVISIONS]]
    assert (await describe(fresh))[0] == HEAD


def test_cli_explains_an_unreachable_database():
    result = run(
        sys.executable,
        "-m",
        "idempotency_asgi",
        "migrate",
        dsn="postgresql://postgres@127.0.0.1:1/postgres",
    )
    assert result.returncode == 1
    assert "database unavailable" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("where", ["after", "before"])
def test_cli_takes_the_database_url_before_or_after_the_command(fresh, where):
    """The documented command (docs/getting-started.md): `idempotency-asgi migrate
    --database-url URL`."""
    option = ["--database-url", fresh]
    args = ["migrate", *option] if where == "after" else [*option, "migrate"]
    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "idempotency_asgi", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("applied ")


def test_an_option_after_the_command_wins_over_the_environment(fresh):
    result = run(
        sys.executable,
        "-m",
        "idempotency_asgi",
        "stats",
        "--database-url",
        "postgresql://postgres@127.0.0.1:1/postgres",
        dsn=fresh,  # DATABASE_URL names a database that works
    )
    assert result.returncode == 1 and "127.0.0.1" in result.stderr
