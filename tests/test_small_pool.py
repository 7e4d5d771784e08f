"""A store made from the application's own small pool, in the atomic mode: while a slow
handler holds every pooled connection, a duplicate of a request in flight is told 409 and a
finished key's replay is served at once, and only a new key waits for a connection. The look
that answers them runs on one connection kept beside the pool (asyncpg's pool says how to
make one only through a private method: without it, the look waits for the pool as
everything else does, which is tested too)."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from idempotency_asgi import PostgresStore
from idempotency_asgi._postgres import database
from tests.apps import AppPool, build_app
from tests.helpers import assert_problem, client, effects, eventually, headers, key_locked, new_key


def small(schema: str) -> tuple[AppPool, PostgresStore]:
    pool = AppPool(schema, 1)
    return pool, PostgresStore(pool, timeout=2.0)


async def test_duplicates_and_replays_are_answered_while_the_pool_is_taken(schema, db, tenant):
    pool, store = small(schema)
    app = build_app(schema, store=store, app_pool=pool, atomic=True)
    finished, running, new = new_key(), new_key(), new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={}, headers=headers(tenant, finished))
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, running, x_delay_ms="3000"))
        )
        await eventually(lambda: key_locked(db, tenant, running))
        started = time.monotonic()
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, running))
        other = await http.post("/tx/charge", json={"x": 1}, headers=headers(tenant, running))
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, finished))
        answered = time.monotonic() - started
        waited = await http.post("/tx/charge", json={}, headers=headers(tenant, new))
        assert (await slow).status_code == 201
    assert first.status_code == 201
    assert_problem(duplicate, 409, "request-in-progress")
    assert_problem(other, 422, "key-reused")
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert answered < 1.0, answered
    # A new key waits for the one connection, up to the store's timeout: then a 503.
    assert_problem(waited, 503, "store-unavailable")
    assert await effects(db, tenant, running) == 1
    assert await effects(db, tenant, new) == 0


async def test_without_a_connection_beside_the_pool_a_replay_waits_for_it(
    schema, db, tenant, monkeypatch
):
    # Another asyncpg, whose pool does not say how it connects: no look apart, and a replay
    # behind the slow handler waits for the pool, as before; it is still answered in time.
    monkeypatch.setattr(database, "POOLS_CONNECT", "_not_in_this_asyncpg")
    pool, store = small(schema)
    app = build_app(schema, store=store, app_pool=pool, atomic=True)
    finished, running = new_key(), new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, finished))
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, running, x_delay_ms="800"))
        )
        await eventually(lambda: key_locked(db, tenant, running))
        started = time.monotonic()
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, finished))
        waited = time.monotonic() - started
        assert (await slow).status_code == 201
    assert store._db.looks is None
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert waited > 0.3, waited  # it waited for the handler's connection


@pytest.mark.parametrize("rounds", [2])
async def test_a_store_closed_and_opened_again_leaves_nothing_behind(schema, tenant, rounds):
    """The short path's timer, its connections lent and kept apart: closed with the store,
    made again when it opens; a request after each opening runs."""
    pool, store = small(schema)
    app = build_app(schema, store=store, app_pool=pool, atomic=True)
    for _ in range(rounds):
        async with client(app) as http:
            answer = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
            assert answer.status_code == 201
        assert store._deadlines._timer is None and not store._deadlines._steps
        assert store._db.looks is None


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "two-phase"])
async def test_the_pool_options_setup_runs_on_every_loan_to_a_handler(schema, db, tenant, atomic):
    # With a URL the store lends connections of its own, as a pool would: `setup` runs on
    # each loan, and the handler's transaction sees what it set (here, the application name).
    loans: list[int] = []

    async def setup(conn: asyncpg.Connection) -> None:
        loans.append(conn.get_server_pid())
        await conn.execute("SET application_name = 'set-up-for-a-handler'")

    store = PostgresStore(schema, timeout=2.0, pool_options={"setup": setup})
    app = build_app(schema, store=store, atomic=atomic)
    keys = [new_key() for _ in range(3)]
    async with client(app) as http:
        answers = [
            await http.post("/tx/isolation", json={}, headers=headers(tenant, key)) for key in keys
        ]
    assert [a.status_code for a in answers] == [201] * 3, [a.text for a in answers]
    assert [a.json()["application_name"] for a in answers] == ["set-up-for-a-handler"] * 3
    assert len(loans) >= 3
    for key in keys:
        assert await effects(db, tenant, key) == 1
