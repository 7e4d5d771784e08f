"""A store given the application's own asyncpg pool: the application may hold every
connection of it. A keyed request then waits at most the store's `timeout` for one and answers
503 (nothing ran, nothing reserved); once the application gives a connection back, keyed
requests run again. Real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from idempotency_asgi import PostgresStore
from tests.apps import build_app
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key


async def test_a_shared_pool_the_application_drained_is_a_503_in_time(schema, db, tenant):
    pool = await asyncpg.create_pool(schema, min_size=1, max_size=1)
    store = PostgresStore(pool, timeout=0.5)
    app = build_app(schema, store=store)
    key = new_key()

    async def scenario():
        held = await pool.acquire()  # the application's own work holds the only connection
        try:
            async with client(app) as http:
                loop = asyncio.get_running_loop()
                started = loop.time()
                refused = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
                waited = loop.time() - started
                reserved = await key_row(db, tenant, key)
                await pool.release(held)
                held = None
                served = await http.post("/plain/charge", json={}, headers=headers(tenant, key))
        finally:
            if held is not None:
                await pool.release(held)
        return refused, waited, reserved, served

    try:
        refused, waited, reserved, served = await asyncio.wait_for(scenario(), 20)
    except asyncio.TimeoutError:
        pytest.fail("a keyed request waited for the drained pool without bound")
    finally:
        await pool.close()
    assert_problem(refused, 503, "store-unavailable")
    assert waited < 3  # about the store's timeout, not for as long as the application holds on
    assert reserved is None
    assert served.status_code == 201
    assert await effects(db, tenant, key) == 1


async def test_a_store_made_from_the_applications_pool_stops_before_that_pool_closes(
    schema, db, tenant
):
    """The application's startup makes its pool and its shutdown closes it, which waits for
    every connection to come back: the maintenance runner's (elected, it keeps one for its
    lock) must be given back first. The store reads the pool when it opens."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from idempotency_asgi import (
        BackgroundMaintenance,
        IdempotencyMiddleware,
        Reaper,
        Sweeper,
        connection,
    )

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["pool"] = await asyncpg.create_pool(schema, min_size=1, max_size=2)
        yield
        await state["pool"].close()

    async def charge(request):
        conn = await connection(request)
        await conn.execute(
            "INSERT INTO effects (tenant, idempotency_key, path) VALUES ($1, $2, '/charge')",
            tenant,
            request.headers["idempotency-key"],
        )
        return JSONResponse({"ok": True}, status_code=201)

    store = PostgresStore(lambda: state["pool"])
    maintenance = BackgroundMaintenance(Reaper(store), Sweeper(store), idle_seconds=0.05)
    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])], lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=lambda scope: tenant,
        atomic=True,
        maintenance=maintenance,
    )
    key = new_key()

    async def scenario():
        async with client(app) as http:
            first = await http.post("/charge", json={}, headers={"idempotency-key": key})
            await asyncio.sleep(0.3)  # the maintenance runner is elected and holds its lock
        return first

    try:
        first = await asyncio.wait_for(scenario(), 20)
    except asyncio.TimeoutError:
        pytest.fail("the application's shutdown waited for a connection the store held")
    assert first.status_code == 201
    assert await effects(db, tenant, key) == 1
