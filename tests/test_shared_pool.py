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
