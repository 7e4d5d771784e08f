"""A session that waits on a request's transaction while it sits idle (see
_postgres/stalls.py): the handler's own session, waiting on its own request, is cancelled after
`transaction_idle_seconds`, and the request fails with its key held; a transaction that is idle
and blocks nobody is left alone. Real PostgreSQL; the waits are real lock waits."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from tests.apps import MODES, app_in_mode
from tests.helpers import assert_problem, client, effects, headers, key_row, new_key


async def _stuck(db: asyncpg.Pool) -> int:
    """Sessions of this database idle in a transaction, or waiting for a lock."""
    count: int = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND (state LIKE 'idle in transaction%' OR wait_event_type = 'Lock')"
    )
    return count


async def _queue_behind(db: asyncpg.Pool, waiter: asyncpg.Connection, lock: str) -> float:
    """Once the request's transaction holds the advisory lock `lock`, wait for it on `waiter`
    (a session of the same role): the wait is cancelled. How long it lasted."""
    while not await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND objid = hashtext($1)::oid",
        lock,
    ):
        await asyncio.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(asyncpg.QueryCanceledError):
        await waiter.execute("SELECT pg_advisory_xact_lock(hashtext($1))", lock)
    return time.monotonic() - started


@pytest.mark.parametrize("mode", MODES)
async def test_a_handler_waiting_on_its_own_request_is_cut_short_and_its_key_held(
    schema, db, tenant, mode
):
    app = app_in_mode(schema, mode, transaction_idle_seconds=0.5)
    key = new_key()
    async with client(app) as http:
        started = time.monotonic()
        stuck = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_wait_on_itself="1")
        )
        took = time.monotonic() - started
        retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        other = await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
    assert_problem(stuck, 500, "transaction-idle")
    assert 0.5 <= took < 3.0, took
    # Held, as for an unknown outcome: no retry runs while what the other session did may
    # have been kept.
    assert_problem(retry, 409, "request-in-progress")
    row = await key_row(db, tenant, key)
    assert row["state"] == "in_flight" and row["held_reason"] == "transaction-idle"
    # The request's write rolled back with its transaction; the server goes on serving.
    assert await effects(db, tenant, key) == 0
    assert other.status_code == 201
    assert await _stuck(db) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_an_idle_transaction_that_blocks_nobody_is_left_alone(schema, db, tenant, mode):
    app = app_in_mode(schema, mode, transaction_idle_seconds=0.3)
    key = new_key()
    async with client(app) as http:
        slow = await http.post(
            "/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1500")
        )
    assert slow.status_code == 201, slow.text
    assert (await key_row(db, tenant, key))["response_status"] == 201
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("mode", ["atomic", "transactional"])
async def test_a_session_queued_behind_an_idle_request_is_cancelled_and_the_request_recorded(
    schema, db, tenant, mode
):
    # Another session of the same role waits for a lock the request's transaction holds
    # while its handler sleeps: the wait is cancelled after the bound, and the request, which
    # did not fail, is recorded as usual.
    app = app_in_mode(schema, mode, transaction_idle_seconds=0.5)
    key, lock = new_key(), new_key()
    waiter = await asyncpg.connect(schema)
    try:
        async with client(app) as http:
            request = asyncio.create_task(
                http.post(
                    "/tx/charge",
                    json={},
                    headers=headers(tenant, key, x_lock=lock, x_delay_ms="3000"),
                )
            )
            waited = await _queue_behind(db, waiter, lock)
            answer = await request
    finally:
        await waiter.close()
    assert 0.4 <= waited < 2.5, waited
    assert answer.status_code == 201, answer.text
    assert (await key_row(db, tenant, key))["response_status"] == 201
    assert await effects(db, tenant, key) == 1


@pytest.mark.parametrize("mode", ["atomic", "transactional"])
async def test_many_handlers_waiting_on_themselves_at_once_are_each_held(schema, db, tenant, mode):
    # Each request is marked before the statement it waits in is cancelled: however soon the
    # handler hears of the cancel, its request is settled as stalled (held), never as an
    # outage (503, its key freed for a retry to run it again).
    app = app_in_mode(schema, mode, transaction_idle_seconds=0.5)
    keys = [new_key() for _ in range(8)]
    async with client(app) as http:
        answers = await asyncio.gather(
            *(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_wait_on_itself="1"))
                for key in keys
            )
        )
    for answer in answers:
        assert_problem(answer, 500, "transaction-idle")
    for key in keys:
        assert (await key_row(db, tenant, key))["held_reason"] == "transaction-idle"
    assert await effects(db, tenant) == 0


@pytest.mark.parametrize("mode", ["atomic", "transactional"])
async def test_a_request_that_blocked_another_and_failed_of_its_own_error_is_freed(
    schema, db, tenant, mode
):
    # The request did not wait on itself: another session waited on it, and was cancelled.
    # It then fails of an error of its own (not the cancelled statement): its key is freed,
    # as for any failure, and a retry runs.
    app = app_in_mode(schema, mode, transaction_idle_seconds=0.5)
    key, lock = new_key(), new_key()
    waiter = await asyncpg.connect(schema)
    try:
        async with client(app) as http:
            request = asyncio.create_task(
                http.post(
                    "/tx/charge",
                    json={},
                    headers=headers(tenant, key, x_lock=lock, x_delay_ms="2000", x_raise="1"),
                )
            )
            await _queue_behind(db, waiter, lock)
            with pytest.raises(RuntimeError, match="handler failed after its write"):
                await request  # in process, the server's 500 is the exception itself
            retry = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
    finally:
        await waiter.close()
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert await effects(db, tenant, key) == 1  # the retry's; the first rolled back
