"""Fail closed: when the key store cannot answer, the application never runs (503)."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from examples.local_postgres import LocalPostgres
from idempotency_asgi import PostgresStore, migrate
from tests.apps import EFFECTS_DDL, build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key


async def test_unreachable_store_is_503_and_the_app_never_runs(schema, tenant):
    calls: list[str] = []
    # Nothing listens on port 1: every connection attempt is refused.
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/postgres", timeout=0.5)
    app = build_app(schema, store=store, calls=calls)
    async with client(app) as http:
        response = await http.post("/plain/charge", json={}, headers=headers(tenant, new_key()))
        passthrough = await http.get("/read")
    assert_problem(response, 503, "store-unavailable")
    assert int(response.headers["retry-after"]) >= 1
    assert calls == []
    assert passthrough.status_code == 200  # the rest of the app keeps serving


async def test_slow_store_is_503_and_the_app_never_runs(schema, db, tenant):
    calls: list[str] = []
    store = PostgresStore(schema, timeout=0.3)
    app = build_app(schema, store=store, calls=calls)
    key = new_key()
    async with client(app) as http, db.acquire() as blocker:
        async with blocker.transaction():
            # Every claim now waits behind this lock, longer than the store's timeout.
            await blocker.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            response = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        # Nothing answered within the timeout and nothing else succeeded meanwhile: the store
        # takes the database for stuck and sends it no work for a short cool-down.
        started = time.monotonic()
        cooling = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
        refused_in = time.monotonic() - started
        await asyncio.sleep(0.3 + 0.2)  # the cool-down (the timeout, here), and a margin
        recovered = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(response, 503, "store-unavailable")
    assert_problem(cooling, 503, "store-unavailable")
    assert refused_in < 0.25  # at once, not after another timeout
    assert calls == ["/tx/charge"]  # only the request after the cool-down ran
    assert recovered.status_code == 201
    assert await effects(db, tenant, key) == 1


@pytest.mark.slow
async def test_stopped_database_is_503_and_the_app_never_runs(tenant):
    server = LocalPostgres.temporary()
    dsn = server.start()
    try:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        await conn.execute(EFFECTS_DDL)
        await conn.close()
        calls: list[str] = []
        app = build_app(dsn, store=PostgresStore(dsn, timeout=1.0), calls=calls)
        async with client(app) as http:
            before = await http.post("/tx/charge", json={}, headers=headers(tenant, "k1"))
            assert before.status_code == 201
            server.crash()
            await asyncio.sleep(0.5)
            after = await http.post("/tx/charge", json={}, headers=headers(tenant, "k2"))
            replay = await http.post("/tx/charge", json={}, headers=headers(tenant, "k1"))
        assert_problem(after, 503, "store-unavailable")
        # Not even a stored replay is served blind: the store is the only source of truth.
        assert_problem(replay, 503, "store-unavailable")
        assert calls == ["/tx/charge"]
    finally:
        server.stop()


async def test_database_failure_inside_the_handler_is_503_and_rolls_back(schema, db, tenant):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        # The handler writes, then its transaction's session is terminated by the server.
        broken = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_kill_conn="1")
        )
        assert_problem(broken, 503, "store-unavailable")
        assert await effects(db, tenant, key) == 0
        assert await key_row(db, tenant, key) is None  # released: the retry runs fresh
        retried = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert retried.status_code == 201
    assert await effects(db, tenant, key) == 1


async def test_unknown_stored_format_is_never_misread_nor_rerun(schema, db, tenant):
    calls: list[str] = []
    app = build_app(schema, calls=calls)
    key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await db.execute(
            "UPDATE idempotency_keys SET format_version = 99"
            " WHERE tenant_id = $1 AND idempotency_key = $2",
            tenant,
            key,
        )
        response = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    assert_problem(response, 503, "record-unreadable")
    assert calls == ["/tx/charge"]
    assert await effects(db, tenant, key) == 1
