"""Waiting instead of 409 (LISTEN/NOTIFY), and the per-tenant in-flight cap."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from idempotency_asgi import PostgresStore, StoreUnavailable
from idempotency_asgi._asgi import middleware as middleware
from idempotency_asgi._postgres.sql import CHANNEL
from tests import modes
from tests.apps import build_app
from tests.helpers import (
    assert_problem,
    client,
    effects,
    eventually,
    headers,
    new_key,
    running,
    sessions,
)
from tests.test_store import QueryCounter


@modes.two_phase
async def test_a_waiting_duplicate_gets_the_replay_woken_by_notify(schema, db, tenant, monkeypatch):
    # No looking again meanwhile (see the next test): only NOTIFY can wake it before 10 s.
    monkeypatch.setattr(middleware, "WAIT_POLL_SECONDS", 30.0)
    counter = QueryCounter()
    store = PostgresStore(schema, pool_options={"init": counter.init})
    app = build_app(schema, store=store, wait_seconds=10)
    key = new_key()
    async with client(app) as http:
        first = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1200"))
        )
        await running(db, tenant, key)
        loop = asyncio.get_running_loop()
        began = loop.time()
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        waited = loop.time() - began
        original = await first
    # Woken when the first finished (1.2 s), not when the 10 s wait ran out.
    assert waited < 6
    assert original.status_code == 201
    assert duplicate.status_code == 201
    assert duplicate.headers["idempotent-replayed"] == "true"
    assert duplicate.content == original.content
    assert await effects(db, tenant, key) == 1
    claims = [q for q in counter.queries if "INSERT INTO idempotency_keys" in q]
    waits = [q for q in counter.queries if "SET has_waiters = true" in q]
    # The first request's claim, the duplicate's claim, and one more after it was woken:
    # over 1.2 s of waiting, nothing polled.
    assert (len(claims), len(waits)) == (3, 1)


@modes.two_phase
async def test_a_lost_wake_up_costs_a_waiter_one_poll_not_its_whole_wait(schema, db, tenant):
    # The duplicate's mark is taken away behind its back, as a mark that lands just as the
    # completion reads the marks would be missed: no NOTIFY comes. It looks again every
    # WAIT_POLL_SECONDS, so it still gets the replay soon after the first request is done.
    app = build_app(schema, wait_seconds=10)
    key = new_key()
    async with client(app) as http:
        first = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1200"))
        )
        await running(db, tenant, key)
        loop = asyncio.get_running_loop()
        began = loop.time()
        duplicate = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key))
        )
        unmarked = 0
        while not first.done():
            unmarked += _count(
                await db.execute(
                    "UPDATE idempotency_leases SET has_waiters = false"
                    " WHERE tenant_id = $1 AND idempotency_key = $2 AND has_waiters",
                    tenant,
                    key,
                )
            )
            await asyncio.sleep(0.005)
        original, answer = await first, await duplicate
        waited = loop.time() - began
    assert unmarked >= 1  # the wake-up was lost, or this test proves nothing
    assert answer.status_code == 201 and answer.headers["idempotent-replayed"] == "true"
    assert answer.content == original.content
    assert waited < 6  # not the 10 s wait: a poll after the first request was done
    assert await effects(db, tenant, key) == 1


def _count(status: str) -> int:
    return int(status.rsplit(" ", 1)[-1])


async def test_the_wait_runs_out_into_a_409(schema, db, tenant):
    app = build_app(schema, wait_seconds=0.3)
    key = new_key()
    async with client(app) as http:
        first = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1500"))
        )
        await running(db, tenant, key)
        loop = asyncio.get_running_loop()
        began = loop.time()
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        waited = loop.time() - began
        await first
    assert_problem(duplicate, 409, "request-in-progress")
    assert "retry-after" in duplicate.headers
    assert waited >= 0.3
    assert await effects(db, tenant, key) == 1


async def test_a_waiter_runs_the_request_itself_when_the_first_fails(schema, db, tenant):
    app = build_app(schema, wait_seconds=10)
    key = new_key()
    async with client(app) as http:
        first = asyncio.create_task(
            http.post(
                "/tx/charge",
                json={},
                headers=headers(tenant, key, x_delay_ms="500", x_status="503"),
            )
        )
        await running(db, tenant, key)
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        failed = await first
    assert failed.status_code == 503
    assert duplicate.status_code == 201 and "idempotent-replayed" not in duplicate.headers
    assert await effects(db, tenant, key) == 1  # the failed attempt rolled back


@modes.two_phase
async def test_notify_is_sent_only_when_someone_waits(schema, db, tenant):
    heard: list[str] = []
    listener = await asyncpg.connect(schema)
    await listener.add_listener(CHANNEL, lambda *args: heard.append(args[-1]))
    try:
        app = build_app(schema, wait_seconds=10)
        async with client(app) as http:
            await http.post("/tx/charge", json={}, headers=headers(tenant, new_key()))
            await asyncio.sleep(0.2)
            assert heard == []  # nobody waited: no NOTIFY
            key = new_key()
            first = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="500"))
            )
            await running(db, tenant, key)
            await http.post("/tx/charge", json={}, headers=headers(tenant, key))
            await first
            await asyncio.sleep(0.2)
        assert len(heard) == 1
        assert tenant not in heard[0] and key not in heard[0]
    finally:
        await listener.close()


@modes.own_connections  # the refused one's look must not wait for the two it counts
async def test_per_tenant_in_flight_cap_answers_429(schema, db, tenant):
    app = build_app(schema, max_in_flight_per_tenant=2)
    other = tenant + "-other"
    done_key = new_key()
    async with client(app) as http:
        await http.post("/tx/charge", json={}, headers=headers(tenant, done_key))
        slow_keys = (new_key(), new_key())
        slow = [
            asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="800"))
            )
            for key in slow_keys
        ]
        for key in slow_keys:
            await running(db, tenant, key)
        # ...and both in their handlers: in the atomic mode the key's lock shows in pg_locks
        # before this process has read its claim's answer and counted the request.
        await eventually(lambda: _in_their_handlers(db, 2))
        refused_key = new_key()
        refused = await http.post("/tx/charge", json={}, headers=headers(tenant, refused_key))
        replay = await http.post("/tx/charge", json={}, headers=headers(tenant, done_key))
        elsewhere = await http.post("/tx/charge", json={}, headers=headers(other, new_key()))
        results = await asyncio.gather(*slow)
        after = await http.post("/tx/charge", json={}, headers=headers(tenant, refused_key))
    body = assert_problem(refused, 429, "too-many-in-flight")
    assert "2" in body["detail"] and int(refused.headers["retry-after"]) >= 1
    assert replay.headers["idempotent-replayed"] == "true"  # replays are never capped
    assert elsewhere.status_code == 201  # other tenants are unaffected
    assert [r.status_code for r in results] == [201, 201]
    assert after.status_code == 201  # nothing was reserved by the refusal
    assert await effects(db, tenant, refused_key) == 1


@modes.two_phase
async def test_twenty_waiters_arriving_together_share_one_listener(schema, db, tenant):
    application = f"waiters-{uuid.uuid4().hex[:8]}"
    store = PostgresStore(
        schema, pool_options={"server_settings": {"application_name": application}}
    )
    app = build_app(schema, store=store, wait_seconds=10)
    key = new_key()
    listening = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'"
    )

    async def scenario():
        async with client(app) as http:
            first = asyncio.create_task(
                http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1500"))
            )
            await running(db, tenant, key)
            duplicates = [
                asyncio.create_task(http.post("/tx/charge", json={}, headers=headers(tenant, key)))
                for _ in range(20)
            ]
            await asyncio.sleep(0.5)  # every duplicate is waiting now
            listeners = await db.fetchval(listening, application)
            return listeners, await first, await asyncio.gather(*duplicates)

    # Bounded: leaked listeners would also keep the pool from closing at shutdown.
    listeners_while_waiting, original, answers = await asyncio.wait_for(scenario(), 60)
    assert listeners_while_waiting == 1
    assert all(a.content == original.content for a in answers)
    assert all(a.headers["idempotent-replayed"] == "true" for a in answers)
    assert await effects(db, tenant, key) == 1


async def test_a_connection_given_back_twice_frees_one_permit(schema):
    store = PostgresStore(schema, max_size=3, timeout=0.3)
    held = [await store.lend() for _ in range(3)]
    try:
        await store.give_back(held[0])
        await store.give_back(held[0])  # a double close must not free a second slot
        held[0] = await store.lend()
        # The pool is full again: the next request waits its timeout and fails closed,
        # instead of passing the gate and waiting for the pool forever.
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.lend(), timeout=5)
    finally:
        for conn in held:
            await store.give_back(conn)
        await asyncio.wait_for(store.close(), 10)


async def test_retry_after_says_when_the_first_request_is_likely_done(schema, db, tenant):
    app = build_app(schema, lease_seconds=30)
    key = new_key()
    async with client(app) as http:
        cold_key = new_key()
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, cold_key, x_delay_ms="1500"))
        )
        await running(db, tenant, cold_key)
        # Nothing known yet about this route: a short hint (a retry costs one statement).
        cold = await http.post("/tx/charge", json={}, headers=headers(tenant, cold_key))
        await slow
        # Now the route is known to take about 1.5 s.
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="1500"))
        )
        await running(db, tenant, key)
        warm = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await slow
    assert_problem(cold, 409, "request-in-progress")
    assert_problem(warm, 409, "request-in-progress")
    assert cold.headers["retry-after"] == "1"
    # Not the lease (30 s): about what is left of a 1.5 s request.
    assert 1 <= int(warm.headers["retry-after"]) <= 4


async def test_retry_after_never_goes_beyond_the_lease(schema, db, tenant):
    app = build_app(schema, lease_seconds=1.0)
    async with client(app) as http:
        # The route takes longer than the lease (the heartbeat keeps it alive).
        await http.post(
            "/tx/charge", json={}, headers=headers(tenant, new_key(), x_delay_ms="2500")
        )
        key = new_key()
        slow = asyncio.create_task(
            http.post("/tx/charge", json={}, headers=headers(tenant, key, x_delay_ms="2500"))
        )
        await running(db, tenant, key)
        duplicate = await http.post("/tx/charge", json={}, headers=headers(tenant, key))
        await slow
    assert_problem(duplicate, 409, "request-in-progress")
    assert duplicate.headers["retry-after"] == "1"


async def _in_their_handlers(db: asyncpg.Pool, count: int) -> bool:
    """Whether `count` requests' handlers have written their effect and wait (`x-delay-ms`)
    in their open transactions."""
    return await sessions(db, "INSERT INTO effects%", "idle in transaction") >= count
