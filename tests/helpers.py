from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
from starlette.types import ASGIApp

from idempotency_asgi._postgres.keyhash import key_lock
from idempotency_asgi.problems import PROFILE_CODES, TYPE_PREFIX


@contextlib.asynccontextmanager
async def client(app: ASGIApp, root_path: str = "") -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client that also runs the app's lifespan (httpx's transport does not),
    so the middleware opens and closes its store as it would under a server."""
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    async with (
        lifespan(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as http,
    ):
        yield http


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, to_app.get, from_app.put)
    )
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        stopped = await from_app.get()
        assert stopped["type"] == "lifespan.shutdown.complete", stopped
        await task


def new_key() -> str:
    return str(uuid.uuid4())


def headers(tenant: str | None, key: str | None = None, **extra: str) -> dict[str, str]:
    result = {k.replace("_", "-"): v for k, v in extra.items()}
    if tenant is not None:
        result["x-tenant"] = tenant
    if key is not None:
        result["idempotency-key"] = key
    return result


async def effects(db: asyncpg.Pool, tenant: str, key: str | None = None) -> int:
    if key is None:
        return int(await db.fetchval("SELECT count(*) FROM effects WHERE tenant = $1", tenant))
    return int(
        await db.fetchval(
            "SELECT count(*) FROM effects WHERE tenant = $1 AND idempotency_key = $2", tenant, key
        )
    )


async def key_row(db: asyncpg.Pool, tenant: str, key: str) -> Any:
    return await db.fetchrow(
        "SELECT * FROM idempotency_keys WHERE tenant_id = $1 AND idempotency_key = $2",
        tenant,
        key,
    )


async def eventually(probe: Any, timeout: float = 10.0) -> Any:
    """Await `probe()` until it returns something truthy, and return that; fail the test when
    `timeout` seconds pass first. For states another task or process produces."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := await probe()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {probe}")
        await asyncio.sleep(0.01)
    return result


async def sessions(db: asyncpg.Pool, pattern: str, state: str = "active") -> int:
    """How many other sessions are in `state` with a statement whose text is LIKE `pattern`:
    running it ('active': a COMMIT slowed by a deferred trigger, say), or, in 'idle in
    transaction', having run it last in a transaction still open."""
    return await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = $2 AND query LIKE $1"
        " AND pid <> pg_backend_pid()",
        pattern,
        state,
    )


async def claimed(db: asyncpg.Pool, tenant: str, key: str) -> Any:
    """Wait until a request with this key has reserved it; return its row."""
    return await eventually(lambda: key_row(db, tenant, key))


async def running(db: asyncpg.Pool, tenant: str, key: str) -> None:
    """Wait until a request with this key runs: its row is there, or (the atomic mode, which
    writes no row until it commits) its transaction holds the key's lock."""

    async def found() -> bool:
        return await key_row(db, tenant, key) is not None or await key_locked(db, tenant, key)

    await eventually(found)


async def key_locked(db: asyncpg.Pool, tenant: str, key: str) -> bool:
    """Whether a transaction holds the key's advisory lock (the atomic mode's), read from
    pg_locks. Trying the lock to find out would take it, for as long as the statement runs:
    a request that tried it in that moment was told the key is in flight (409), and never ran.
    """
    return bool(
        await db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 1 AND ((classid::int8 << 32) | objid::int8) = $1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))",
            key_lock(tenant, key),
        )
    )


def assert_problem(response: httpx.Response, status: int, name: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["type"] == TYPE_PREFIX + name
    assert body["code"] == PROFILE_CODES.get(name, name)
    assert body["status"] == status
    assert body["title"] and body["detail"]
    return body


@contextlib.asynccontextmanager
async def fresh_database(dsn: str) -> AsyncIterator[str]:
    """A new, empty database on the same server, dropped afterwards."""
    from urllib.parse import urlsplit, urlunsplit

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield urlunsplit(urlsplit(dsn)._replace(path="/" + name))
        finally:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()
